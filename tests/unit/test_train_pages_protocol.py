"""``TrainPages`` is typed by what it takes of its view (issue 74): a Protocol of public members, not ``Any`` with
its private methods called, so a change to ``server.View`` that breaks the training pages is a type error."""

from __future__ import annotations

import inspect
import typing

from gym_runtime.view import server, train_pages
from gym_runtime.view.train_pages import Pages, TrainPages


def test_the_training_pages_take_their_view_as_a_protocol_of_public_members() -> None:
    assert typing.get_type_hints(TrainPages.__init__)["view"] is Pages
    members = {name for name in dir(Pages) if not name.startswith("_")} | set(Pages.__annotations__)
    assert members == {"runs", "row_meta", "render"}
    assert all(callable(getattr(server.View, name)) for name in members - {"runs"})
    assert "self.view._" not in inspect.getsource(train_pages)
