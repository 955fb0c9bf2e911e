"""A rank's error, whole and classified, through the record stream (#45), without Ray.

What is deterministic (retrying cannot help: a `UserError`, an error raised in the user's
own code that is no infrastructure fault), the whole message (every line, untruncated),
and the driver's side: the recorder calls its stop callback once, on the first
deterministic error, and picks the message the summary shows.
"""

from __future__ import annotations

import pytest

from raytrain_ddp.driver.stream import Recorder
from raytrain_ddp.errors import UserError, is_deterministic, whole_message
from raytrain_ddp.parallel import registry
from raytrain_ddp.parallel import registry
from raytrain_ddp.parallel.errors import CollectiveTimeoutError, UnusedParameterError
from raytrain_ddp.rundir import Location
from raytrain_ddp.worker.failure import error_record

pytestmark = pytest.mark.timeout(60)


def _raised_in(path, code: str) -> BaseException:
    path.write_text(code)
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    try:
        scope["boom"]()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_what_is_deterministic(tmp_path):
    assert is_deterministic(UnusedParameterError("x")) and is_deterministic(UserError("bad key"))
    users = _raised_in(tmp_path / "model.py", "def boom():\n    raise ValueError('shape')\n")
    assert is_deterministic(users)
    assert not is_deterministic(_raised_in(tmp_path / "m2.py", "def boom():\n    raise ConnectionResetError('peer')\n"))
    assert not is_deterministic(_raised_in(tmp_path / "m3.py", "from raytrain_ddp.parallel.errors import "
                                           "CollectiveTimeoutError as E\ndef boom():\n    raise E('lost')\n"))
    assert not is_deterministic(CollectiveTimeoutError("all-reduce did not finish"))
    with pytest.raises(ValueError) as ours:  # raised in our own code (as an injected fault is): retried
        registry.get("no-such-strategy")
    assert not is_deterministic(ours.value)


def test_the_whole_message_keeps_every_line_and_character(tmp_path):
    long = "a" * 600 + " middle " + "z" * 600
    exc = _raised_in(tmp_path / "net.py", f"def boom():\n    raise ValueError('first line\\n{long}')\n")
    text = whole_message(exc)
    assert text.startswith("ValueError: first line\n" + long) and text.endswith("net.py:2 in boom)"), text
    assert len(text) > 1200
    assert whole_message(UnusedParameterError("14 trainable parameter(s) ...")) == "14 trainable parameter(s) ..."
    assert error_record(exc, 1) == {"message": text, "type": "ValueError", "rank": 1, "deterministic": True}


def test_recorder_stops_the_fit_once_and_shows_the_deterministic_error(tmp_path):
    recorder = Recorder(Location.parse(str(tmp_path)), "fit", [])
    stopped = []
    recorder.on_deterministic_error = stopped.append
    lost = {"message": "CollectiveTimeoutError: peer lost", "deterministic": False}
    first = {"message": "x" * 1500, "deterministic": True}
    recorder.handle([{"kind": "error", "record": lost}])
    assert stopped == [] and recorder.error_to_show("Ray's own text") is None  # Ray's account stands
    assert recorder.error_to_show("... (Output truncated. See ...)") == lost["message"]
    recorder.handle([{"kind": "error", "record": first}, {"kind": "error", "record": {**first, "message": "y"}}])
    assert stopped == [first]  # once: the controller is stopped at the first
    assert recorder.error_to_show("anything") == first["message"]
