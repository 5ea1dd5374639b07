"""A named killed while it writes a zone's journal can leave the journal torn, and then refuses
that zone when it starts again (seen in the fault matrix: an empty ``default.db.jnl`` after a
SIGKILL, ``journal open failed: no more``).  ``relaunch_bind`` does what docs/dns.md tells an
operator to do: the unreadable journal is moved aside, the sound ones are kept."""

from __future__ import annotations

import dns.asyncquery
import dns.rcode
import dns.update

from tests.controlplane.dns_helpers import answer
from tests.support import BindServer, relaunch_bind
from tests.support.bind import set_aside_torn_journals


async def _add(bind: BindServer, view: str, name: str, address: str) -> None:
    update = dns.update.UpdateMessage(bind.zone, keyring=bind.view(view).key.keyring())
    update.add(name, 30, "A", address)
    response = await dns.asyncquery.tcp(update, bind.host, port=bind.port, timeout=5)
    assert response.rcode() == dns.rcode.NOERROR, dns.rcode.to_text(response.rcode())


async def test_a_torn_journal_is_set_aside_and_named_serves_every_view_again(
    bind: BindServer,
) -> None:
    views = [v.name for v in bind.views]
    assert len(views) >= 2, views
    torn_view, sound_view = views[0], views[1]
    name = f"kept.{bind.zone}"
    for i, view in enumerate(views):
        await _add(bind, view, name, f"192.0.2.{10 + i}")
    bind.process.kill()
    zones = bind.work_dir / "zones"
    torn = zones / f"{torn_view}.db.jnl"
    sound = zones / f"{sound_view}.db.jnl"
    assert torn.stat().st_size > 0 and sound.stat().st_size > 0
    torn.write_bytes(b"")  # what a SIGKILL inside the journal's first write leaves

    again = relaunch_bind(bind)  # waits until every view serves the zone
    try:
        assert not torn.exists() and (zones / f"{torn_view}.db.jnl.torn").exists()
        assert sound.exists()  # a sound journal is kept, and with it the view's records
        assert await answer(again, again.view(sound_view).source, name, "A") == {"192.0.2.11"}
        # the torn view is back as of the zone's last dump
        assert await answer(again, again.view(torn_view).source, name, "A") == set()
        assert set_aside_torn_journals(bind.work_dir) == []  # nothing torn is left
    finally:
        again.process.stop()
