"""Settings files and flags into one pydantic-settings object, and its errors in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pydantic
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

S = TypeVar("S", bound=BaseSettings)


def load_settings(
    cls: type[S], *, config_file: Path | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Settings from ``overrides`` (flags) > environment > ``config_file`` (TOML) > defaults."""
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class _Loaded(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if config_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
            return tuple(sources)

    loaded: S = _Loaded(**(overrides or {}))
    return loaded


def explain(exc: pydantic.ValidationError) -> str:
    """A validation error as an operator reads it: one ``field.path: problem`` per line."""
    lines = [
        f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
    ]
    return "invalid settings:\n" + "\n".join(lines)
