"""``meridianctl``: the operators' runbook CLI.  It talks only to the admin API (HTTP, httpx)
and imports nothing of Meridian but ``meridian_wire``.  See docs/meridianctl.md."""
