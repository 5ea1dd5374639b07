"""``bindconf.render``: the named.conf it prints passes named-checkconf and runs a real BIND9
whose views answer per client address and accept only their own key's updates; the
``meridian-controller dns bind-config`` command; ``[dns]`` settings errors name the field."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import pydantic
import pytest

from controlplane import cli
from controlplane.dns import bindconf, rfc2136
from controlplane.dns.errors import DnsRefused
from controlplane.settings import ControllerSettings
from controlplane.settings.dns import DnsSettings
from policies.dns_plan import Change, RecordSet
from tests.controlplane.dns_helpers import API, answer
from tests.support import DnsView, TsigKey, check_conf, start_bind_with, zone_file

ZONE = "meridian.test."


def _secret() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


def _settings(*, port: int = 53, shared: bool = False) -> DnsSettings:
    views: list[dict[str, object]] = [
        {"name": "geo-a", "geo": "eu", "match_clients": ["127.0.0.2"]},
        {"name": "default", "geo": "us"},
    ]
    body: dict[str, object] = {"backend": "rfc2136", "port": port, "zone": ZONE, "views": views}
    if shared:
        body["tsig"] = {"name": "meridian", "secret": _secret()}
    else:
        for view in views:
            view["tsig"] = {"name": f"meridian-{view['name']}", "secret": _secret()}
    return DnsSettings.model_validate(body)


def _views(settings: DnsSettings) -> tuple[DnsView, ...]:
    out = []
    for view, source in zip(settings.views, ("127.0.0.2", "127.0.0.1"), strict=True):
        key = settings.key(view.name)
        assert key is not None
        secret = key.secret.get_secret_value()
        out.append(
            DnsView(name=view.name, source=source, key=TsigKey(name=key.name, secret=secret))
        )
    return tuple(out)


@pytest.mark.parametrize("shared", [False, True], ids=["own-keys", "shared-secret"])
async def test_the_rendered_config_loads_in_bind_and_steers_by_view(
    tmp_path: Path, shared: bool
) -> None:
    settings = _settings(shared=shared)
    views = _views(settings)
    zones = {f"{v.name}.{ZONE}db": zone_file() for v in settings.views}
    with start_bind_with(
        tmp_path,
        body=lambda work: bindconf.render(settings, zone_dir=str(work / "zones")),
        zone_files=zones,
        views=views,
    ) as bind:
        check_conf(bind.work_dir / "named.conf")
        live = settings.model_copy(update={"port": bind.port})
        client = rfc2136.Client(live)
        for view, address in (("geo-a", "192.0.2.10"), ("default", "198.51.100.20")):
            rrset = RecordSet(name=API, rdtype="A", ttl_s=30, values=(address,))
            await client.update(view, [Change(op="replace", rrset=rrset)])
        assert await answer(bind, "127.0.0.2", API, "A") == {"192.0.2.10"}
        assert await answer(bind, "127.0.0.1", API, "A") == {"198.51.100.20"}
        # a view without its key: the update is unsigned and refused
        unsigned = live.model_copy(
            update={"views": [v.model_copy(update={"tsig": None}) for v in live.views],
                    "tsig": None}
        )  # fmt: skip
        with pytest.raises(DnsRefused, match="REFUSED"):
            rrset = RecordSet(name=API, rdtype="A", ttl_s=30, values=("203.0.113.1",))
            await rfc2136.Client(unsigned).update("default", [Change(op="replace", rrset=rrset)])
        assert await answer(bind, "127.0.0.1", API, "A") == {"198.51.100.20"}


def test_render_names_keys_views_acls_and_update_policy() -> None:
    settings = _settings()
    text = bindconf.render(settings, zone_dir="/var/lib/bind")
    assert 'key "meridian-geo-a" {' in text and "algorithm hmac-sha256;" in text
    assert 'acl "meridian-geo-a-clients" {\n    127.0.0.2;\n};' in text
    assert 'match-clients { !key "meridian-default"; key "meridian-geo-a"; ' in text
    assert 'match-clients { !key "meridian-geo-a"; key "meridian-default"; any; };' in text
    assert 'update-policy { grant "meridian-geo-a" zonesub ANY; };' in text
    assert 'file "/var/lib/bind/geo-a.meridian.test.db";' in text
    assert "geoip" in text  # the production hint


def test_the_cli_prints_the_config_and_rejects_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = _secret()
    config = tmp_path / "controller.toml"
    config.write_text(
        "[dns]\nbackend = 'dry-run'\nzone = 'meridian.test.'\n"
        f"[dns.tsig]\nname = 'meridian'\nsecret = '{secret}'\n"
        "[[dns.views]]\nname = 'eu'\ngeo = 'eu'\nmatch_clients = ['geoip country DE']\n"
        "[[dns.views]]\nname = 'default'\ngeo = 'us'\n"
    )
    assert cli.main(["dns", "bind-config", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert 'key "meridian-eu"' in out and 'key "meridian-default"' in out
    assert "geoip country DE;" in out and secret in out

    config.write_text("[dns]\nbackend = 'rfc2136'\n")  # no views
    assert cli.main(["dns", "bind-config", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "dns" in err and "needs at least one view" in err


@pytest.mark.parametrize(
    ("dns", "where", "what"),
    [
        ({"ttl_s": -1}, "dns.ttl_s", "greater than or equal"),
        ({"server": "bind.example"}, "dns.server", "must be an IP address"),
        ({"backend": "rfc2136"}, "dns", "needs at least one view"),
        (
            {"views": [{"name": "a", "geo": "eu"}, {"name": "a", "geo": "us"}]},
            "dns",
            "views[1].name: duplicate view",
        ),
        (
            {"tsig": {"name": "k", "secret": "not base64!"}},
            "dns.tsig.secret",
            "must be base64",
        ),
        ({"srv": "_https._tcp.api.example."}, "dns.srv", "relative to the zone"),
    ],
)
def test_invalid_dns_settings_name_the_field(dns: dict[str, object], where: str, what: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ControllerSettings(dns=dns)  # type: ignore[arg-type]
    errors = info.value.errors()
    assert any(".".join(str(p) for p in e["loc"]) == where and what in e["msg"] for e in errors), (
        errors
    )


def test_dns_is_off_by_default() -> None:
    assert ControllerSettings().dns.backend == "off"
