"""`scaling.launcher: torchrun`'s mailbox over a local socket (`driver/torchrun.py`): rank 0's
`Outbox` makes every call through `MailboxClient` that it makes on a `LocalMailbox` in local
mode. A call the client lacks ended rank 0 at its first checkpoint (`durable_for`, added to the
mailbox after the client was written), so the two lists are held together here."""

from __future__ import annotations

import inspect
import pickle

import pytest

from raytrain_ddp.driver.stream import LocalMailbox
from raytrain_ddp.driver.torchrun import MailboxClient, MailboxServer
from raytrain_ddp.worker.meter import Outbox

pytestmark = pytest.mark.timeout(30)

DRIVER_SIDE = {"take", "set_durable"}  # the recorder's calls, in the driver's own process


def _public(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_the_client_has_every_call_the_local_mailbox_answers_for_the_ranks():
    assert _public(LocalMailbox) - DRIVER_SIDE - _public(MailboxClient) == set()


def test_rank_zeros_outbox_works_through_the_socket():
    mailbox = LocalMailbox()
    server = MailboxServer(mailbox)
    try:
        client = pickle.loads(pickle.dumps(server.client()))  # as the ranks get it, in the job's pickle
        outbox = Outbox(client)
        assert outbox.start_attempt({"fit_id": "f", "time": 1.0}) == 1
        outbox.send("metrics", record={"step": 1})
        outbox.flush()
        assert outbox.durable_step() == 0  # nothing written yet
        mailbox.set_durable(1, 7)  # the recorder wrote attempt 1's lines up to step 7
        assert outbox.durable_step() == 7
        assert not outbox.stop_requested()
        client.request_stop()
        assert outbox.stop_requested()
        kinds = [e["kind"] for e in mailbox.take(0.0)]
        assert kinds == ["attempt", "metrics"], kinds
    finally:
        server.close()
