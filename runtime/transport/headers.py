"""The NATS headers the runtime's messages carry (names only: one place, so permissions and tools agree)."""

ERROR_HEADER = "Gym-Error"
REPLY_HEADER = "Gym-Reply"  # where a JetStream-queued request wants its answer
MSG_ID_HEADER = "Nats-Msg-Id"
# what JetStream sets on a direct get's answer (never on a message a client stores)
DIRECT_GET_HEADERS = ("Nats-Stream", "Nats-Sequence", "Nats-Subject")
BLOB_HEADER = "Gym-Blob"  # the body is in a blob stream: "{role}.{pool}.{key}.{chunks}.{sha256 hex}"
TTL_HEADER = "Nats-TTL"  # a stored message's own time to live (seconds): a call's or reply's large body
PROGRESS_HEADER = "Gym-Progress"  # "still working": keeps a caller's liveness timer alive
# the handler waits for a sandbox lease ("1"), or stopped waiting ("SECONDS" it waited): off the caller's clock
PAUSE_HEADER = "Gym-Paused"
# a part of the handler's output as it is produced, before the reply ("1" stdout, "2" stderr; the body: its bytes)
OUTPUT_HEADER = "Gym-Output"
BUSY_HEADER = "Gym-Busy"  # "no free slot here": a direct call goes to the work queue instead
EXPIRES_HEADER = "Gym-Expires"  # a queued request's caller stops waiting for a worker then (epoch seconds)
