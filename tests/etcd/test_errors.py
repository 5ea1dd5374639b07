"""Every exception aetcd and gRPC can raise is classified (in the style of httpx's
``test_httpcore_all_exceptions_mapped``), and the endpoint parser says what to write."""

from __future__ import annotations

import asyncio
import inspect
from types import ModuleType

import aetcd.exceptions
import grpc
import grpc.aio
import pytest

from meridian_etcd import endpoints, errors
from meridian_etcd.errors import LeaseLost, Refused, TokenExpired, Unavailable


def _exception_classes(module: ModuleType) -> set[type[BaseException]]:
    return {
        value
        for value in vars(module).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
    }


@pytest.mark.parametrize("module", [aetcd.exceptions, grpc, grpc.aio], ids=lambda m: m.__name__)
def test_every_exception_class_of_aetcd_and_grpc_is_in_the_table(module: ModuleType) -> None:
    foreign = {c for c in _exception_classes(module) if c.__module__.split(".")[0] != "builtins"}
    assert foreign, f"{module.__name__} defines no exception class: the test finds nothing"
    unmapped = sorted(c.__qualname__ for c in foreign - set(errors.BY_CLASS))
    assert not unmapped, f"classify these in meridian_etcd/errors.py BY_CLASS: {unmapped}"


def test_every_grpc_status_code_but_ok_has_a_kind() -> None:
    missing = [c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK]
    missing = [name for name in missing if grpc.StatusCode[name] not in errors.BY_STATUS]
    assert not missing, f"classify these in meridian_etcd/errors.py BY_STATUS: {missing}"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code=code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(),
        details=details,
    )


def _from_aetcd(rpc: grpc.aio.AioRpcError) -> BaseException:
    """What aetcd raises for ``rpc``: its own exception class, raised from it."""
    try:
        aetcd.exceptions._handle_exception(rpc)
    except aetcd.exceptions.ClientError as exc:
        return exc
    raise AssertionError("aetcd raised nothing")


@pytest.mark.parametrize(
    ("code", "details", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "context deadline exceeded", Unavailable),
        (grpc.StatusCode.UNKNOWN, "context deadline exceeded", Unavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests", Unavailable),
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", Unavailable),
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", LeaseLost),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", Refused),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", Refused),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", TokenExpired),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: something else", Refused),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: revision of auth store is old",
         TokenExpired),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", TokenExpired),
        (grpc.StatusCode.INVALID_ARGUMENT,
         "etcdserver: authentication failed, invalid user ID or password", Refused),
        (grpc.StatusCode.UNKNOWN,
         "auth: authentication failed, password was given for no password user", Refused),
        (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: authentication is not enabled",
         Refused),
        (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists", Refused),
        (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted",
         Refused),
    ],
)  # fmt: skip
def test_what_etcd_says_is_classified_by_its_status_code(
    code: grpc.StatusCode, details: str, kind: type[errors.EtcdError]
) -> None:
    rpc = _rpc_error(code, details)
    assert errors.classify(rpc) is kind  # raw, as a watch stream raises it
    wrapped = _from_aetcd(rpc)
    assert errors.classify(wrapped) is kind  # through aetcd's own classes
    message = errors.message_of(wrapped)
    # etcd's words, or the class aetcd named it by where it keeps none (DuplicateLeaseError)
    assert details in message or message == type(wrapped).__name__


def test_failures_that_are_not_etcd_s_are_left_to_rise() -> None:
    assert errors.classify(ValueError("a bug")) is None
    assert errors.classify(KeyError("a bug")) is None
    assert errors.classify(ConnectionRefusedError(111, "refused")) is Unavailable
    assert errors.classify(TimeoutError()) is Unavailable
    assert errors.classify(asyncio.CancelledError()) is Unavailable  # the client checks whose
    assert errors.classify(aetcd.exceptions.ClientError(ValueError("wrapped"))) is Unavailable


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://127.0.0.1:2379", "127.0.0.1", 2379),
        ("http://etcd-0.etcd:32379/", "etcd-0.etcd", 32379),
        ("http://10.1.2.3", "10.1.2.3", 2379),
        ("http://[::1]:2379", "::1", 2379),
        ("https://etcd-0.etcd:2379", "etcd-0.etcd", 2379),
    ],
)
def test_endpoints_parse(url: str, host: str, port: int) -> None:
    endpoint = endpoints.parse(url)
    assert (endpoint.host, endpoint.port) == (host, port)
    assert endpoint.tls == url.startswith("https://")
    assert endpoints.parse(endpoint.url) == endpoint


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("10.0.0.1:2379", "must look like http://host:2379"),
        ("grpc://10.0.0.1:2379", "must look like http://host:2379"),
        ("http://10.0.0.1:2379/v3", "no path"),
        ("http://10.0.0.1:notaport", "not a URL"),
    ],
)
def test_bad_endpoints_are_refused_with_what_to_write(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        endpoints.parse(url)


def test_the_details_table_only_names_codes_that_the_status_table_has() -> None:
    assert {code for code, _ in errors.BY_DETAILS} <= set(errors.BY_STATUS)


CA = {"etcd.ca_file": "/etc/meridian/etcd-ca.pem", "etcd.cert_file": None, "etcd.key_file": None}
NO_TLS = dict.fromkeys(CA)


@pytest.mark.parametrize(
    ("urls", "tls", "says"),
    [
        (["https://10.0.0.1:2379"], NO_TLS, "set etcd.ca_file"),
        (["https://10.0.0.1:2379"], NO_TLS, "TLS to etcd is not set up"),
        (["https://10.0.0.1:2379", "http://10.0.0.2:2379"], CA, "mix http:// and https://"),
        (["http://10.0.0.1:2379"], CA, "plaintext http:// but etcd.ca_file is set"),
        (["http://10.0.0.1:2379"], {**NO_TLS, "etcd.cert_file": "c", "etcd.key_file": "k"},
         "etcd.cert_file, etcd.key_file are set"),
    ],
)  # fmt: skip
def test_tls_and_schemes_must_agree_and_nothing_is_downgraded(
    urls: list[str], tls: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        endpoints.parse_all(urls, tls=tls, ca_setting="etcd.ca_file")


def test_https_with_a_ca_and_http_without_tls_are_accepted() -> None:
    assert all(e.tls for e in endpoints.parse_all(["https://a:2379", "https://b"], tls=CA,
                                                  ca_setting="etcd.ca_file"))  # fmt: skip
    assert not endpoints.parse_all(["http://a:2379"], tls=NO_TLS)[0].tls
    with pytest.raises(ValueError, match="mix"):
        endpoints.parse_all(["http://a:2379", "https://b:2379"])
