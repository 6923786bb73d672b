"""Reading the server's protocol: nats-py's parser, with its two hot lines read without regular expressions.

nats-py matches each control line against up to seven regular expressions, tried in turn, and cuts every
message off the front of its buffer (a copy of all that follows it, per message: a burst read at once is copied
over and over). Here a ``MSG`` or ``HMSG`` line, nearly all that a runtime reads, is split on its spaces, the
buffer is read by position and cut once per read, and anything else (``PING``, ``INFO``, ``-ERR``, a split or
odd line) goes to nats-py's own parser, as before. What the client is handed is what nats-py hands it
(``tests/test_protocol_reader.py``)."""

from __future__ import annotations

from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

_CRLF = b"\r\n"
_MSG = b"MSG "
_HMSG = b"HMSG "


class ProtocolReader(Parser):
    """One connection's parser (``Client._ps``)."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        pos = 0
        nc = self.nc
        take_now = getattr(nc, "take_now", None)  # ``connect.Client``'s: an inline callback's message, at once
        try:
            while pos < len(buf):
                if self.state == AWAITING_MSG_PAYLOAD:
                    end = pos + self.needed
                    if len(buf) < end + 2:
                        return  # the rest of the payload is still on its way
                    arg = self.msg_arg
                    header_size = self.header_needed
                    if header_size:
                        headers: bytes | None = bytes(buf[pos : pos + header_size])
                        payload = bytes(buf[pos + header_size : end])
                        self.header_needed = 0
                    else:
                        headers = None
                        payload = bytes(buf[pos:end])
                    pos = end + 2
                    self.state = AWAITING_CONTROL_LINE
                    sid, subject, reply = arg["sid"], arg["subject"], arg["reply"]
                    if take_now is None or not take_now(sid, subject, reply, payload, headers):
                        await nc._process_msg(sid, subject, reply, payload, headers)
                    if self.buf is not buf:  # the connection was reset meanwhile: nothing of this buffer is read
                        return
                    continue
                line_end = self._message_line(pos) if buf.startswith(_MSG, pos) or buf.startswith(_HMSG, pos) else 0
                if not line_end:
                    if pos:  # nats-py's parser reads from the front of its buffer
                        del buf[:pos]
                        pos = 0
                    await super().parse()
                    return
                pos = line_end
        finally:
            if pos and self.buf is buf:
                del buf[:pos]

    def _message_line(self, pos: int) -> int:
        """Take the ``MSG``/``HMSG`` line at ``pos`` into the parser's state, and say where the payload starts; 0
        (nothing taken) for a line not yet whole, or one that is not the plain form the server writes (nats-py's
        parser then reads it)."""
        buf = self.buf
        eol = buf.find(_CRLF, pos)
        if eol < 0:
            return 0
        parts = bytes(buf[pos:eol]).split(b" ")
        n = len(parts)
        if parts[0] == b"MSG":
            sizes = parts[-1:]
        else:
            sizes = parts[-2:]
            n -= 1
        if (n != 4 and n != 5) or b"" in parts or not b"".join(sizes).isdigit() or not parts[2].isdigit():
            return 0
        arg = self.msg_arg
        arg["subject"] = parts[1]
        arg["sid"] = int(parts[2])
        arg["reply"] = parts[3] if n == 5 else b""
        self.needed = int(sizes[-1])
        self.header_needed = int(sizes[0]) if len(sizes) == 2 else 0
        self.state = AWAITING_MSG_PAYLOAD
        return eol + 2
