"""Settings: defaults < config file < environment (DEVPLUG_*) < command-line flags.

Everything is validated before anything is served; a problem becomes a
:class:`~devplug.errors.ConfigError` naming the field and what would be valid
(:mod:`.messages`). The file is read by :mod:`.files`, addresses are checked by
:mod:`.address`. Scanner sections are kept raw here and validated by each scanner
(``devplug.scanners.registry``), so this package does not depend on the scanners.

May use: errors, naming, pydantic and YAML. Never the scanners, the fronts or the composition:
they all read settings from here.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from devplug.config.address import parse_address
from devplug.config.files import read_config_file
from devplug.config.messages import config_error
from devplug.config.scanner_names import Respelling, scanner_name
from devplug.errors import ConfigError
from devplug.naming import (
    cdi_kind_problem,
    driver_name_problem,
    resource_name_problem,
    spec_files,
)

__all__ = [
    "DEFAULT_CDI_DIR",
    "DEFAULT_KUBELET_DIR",
    "DEFAULT_KUBELET_ROOT",
    "ENV_PREFIX",
    "SCALAR_KEYS",
    "CdiSettings",
    "DraSettings",
    "HotplugSettings",
    "Respelling",
    "SectionSettings",
    "Settings",
    "StrictModel",
    "config_error",
    "env_overrides",
    "env_scanners",
    "load_settings",
    "parse_address",
    "path_problem",
    "read_config_file",
]

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
ENV_PREFIX = "DEVPLUG_"
_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,-]{0,62}")

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]


class StrictModel(BaseModel):
    """Frozen, and unknown keys are errors (a typo must not be silently ignored).

    A YAML ``true`` or ``false`` given to a number field is refused too (pydantic alone would
    read ``shares: true`` as 1).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _wants_number(field.annotation):
                raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


def _wants_number(annotation: Any) -> bool:
    """Whether a field takes a number and never a boolean (``int``, ``float | None``, ...)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and bool not in args and all(a in (int, float) for a in args)
    return False


def path_problem(value: Path) -> str | None:
    """Why ``value`` cannot be one of devplug's directories: relative, or holding a NUL byte."""
    if "\0" in str(value):
        return f"must not contain a NUL byte, got {str(value)!r}"
    if not value.is_absolute():
        return f"must be an absolute path, got {str(value)!r}"
    return None


class SectionSettings(StrictModel):
    """A scanner's config section: :meth:`from_raw` validates it with errors naming the field.

    Checks across fields go in :meth:`check_section`, which raises ConfigError.
    """

    @classmethod
    def from_raw(cls, raw: Any, field: str) -> Self:
        """The section ``field`` of the config file (``None`` when it is empty: the defaults)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(field, "must be a mapping of settings (or empty for the defaults)")
        try:
            settings = cls.model_validate(raw)
        except ValidationError as exc:
            raise config_error(exc, field, cls) from None
        settings.check_section(field)
        return settings

    def check_section(self, field: str) -> None:
        """Raise ConfigError for a combination of values the fields alone cannot refuse."""


HotplugSource = Literal["auto", "udev", "kernel", "none"]


class HotplugSettings(StrictModel):
    """How devplug notices device changes: udev events, with periodic full rescans as a net.

    ``source``: ``auto`` listens to udevd's events when /run/udev/control exists, else to the
    kernel's; ``none`` only polls. ``coalesce_ms``: the longest a burst of events is waited
    for before it is handled as one batch (it ends sooner, once no event came for 0.5 ms).
    ``resync_s``: full rescan period while events are received; ``poll_s``: full rescan
    period without them (source none, or no monitor could be opened).
    ``health_hold_down_s``: a device that recovers is advertised Healthy only after staying
    healthy this long (turning Unhealthy is advertised at once).
    """

    source: HotplugSource = "auto"
    coalesce_ms: float = Field(default=3.0, ge=0, le=10_000)
    resync_s: float = Field(default=60.0, gt=0, le=86_400)
    poll_s: float = Field(default=5.0, gt=0, le=86_400)
    health_hold_down_s: float = Field(default=5.0, ge=0, le=3600)


class CdiSettings(StrictModel):
    """CDI spec files: one per resource, ``<vendor>-<class>.json`` in ``dir``.

    ``annotations``: also name the devices in ``cdi.k8s.io/`` annotations of the Allocate
    answer, for runtimes that read CDI devices only from annotations (before Kubernetes 1.29
    passed them in the CRI). ``device_specs``: keep returning device nodes and mounts in
    Allocate besides the CDI names (on by default: a runtime without CDI support still gets
    the devices, and CDI injection replaces a node of the same path rather than adding it
    twice). Env is always returned in Allocate: specs do not carry it. ``keep_on_exit``:
    leave the specs in place when devplug stops. ``kinds``: resource -> CDI kind, where the
    resource name itself is not the kind wanted.
    ``instance``: written into each spec's ownership record (in ``.devplug/``); start-up
    clean-up removes only this instance's old specs. Defaults to the configured scanners'
    names, so two devplug DaemonSets with different scanners sharing a CDI dir leave each
    other's specs alone; set it when two instances run the same scanners.
    """

    enabled: bool = True
    dir: Path = DEFAULT_CDI_DIR
    annotations: bool = False
    device_specs: bool = True
    keep_on_exit: bool = False
    kinds: dict[str, str] = Field(default_factory=dict)
    instance: str | None = None

    @field_validator("dir")
    @classmethod
    def _absolute_dir(cls, value: Path) -> Path:
        problem = path_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("instance")
    @classmethod
    def _instance_name(cls, value: str | None) -> str | None:
        if value is not None and _INSTANCE.fullmatch(value) is None:
            raise ValueError(
                "must be 1 to 63 letters, digits and '_ . , -', starting with a letter or "
                f"digit; got {value!r}"
            )
        return value

    @field_validator("kinds")
    @classmethod
    def _valid_kinds(cls, value: dict[str, str]) -> dict[str, str]:
        for resource, kind in value.items():
            problem = resource_name_problem(resource)
            if problem is not None:
                raise ValueError(f"{resource!r} is not a resource name: {problem}")
            problem = cdi_kind_problem(kind)
            if problem is not None:
                raise ValueError(f"kind {kind!r} for {resource!r}: {problem}")
        _, clashes = spec_files(value)
        if clashes:
            raise ValueError(f"{clashes[0].problem}; give them different kinds")
        return value


class DraSettings(StrictModel):
    """Serving resources through Dynamic Resource Allocation instead of the device plugin API.

    ``driver``: the DRA driver name (a DNS subdomain of at most 63 characters, the vendor's
    domain: ``gpu.intel.com``). ``resources``: the resources served through DRA, and only
    through it: the device-plugin front neither serves nor registers them (a resource is
    served by exactly one front on a node). ``kubelet_root``: the kubelet's ``--root-dir``;
    the registration socket goes in ``<root>/plugins_registry``, the DRA socket and the
    checkpoint in ``<root>/plugins/<driver>/``. Which API server and node: the ``KUBECONFIG``
    and ``NODE_NAME`` variables, or the in-cluster config (see docs/dra.md).
    """

    driver: str
    resources: tuple[str, ...]
    kubelet_root: Path = DEFAULT_KUBELET_ROOT

    @field_validator("driver")
    @classmethod
    def _driver_name(cls, value: str) -> str:
        problem = driver_name_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} is not a DRA driver name: {problem}")
        return value

    @field_validator("resources")
    @classmethod
    def _resource_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(
                "name at least one resource to serve through DRA (without any, leave the dra "
                "section out)"
            )
        for resource in value:
            problem = resource_name_problem(resource)
            if problem is not None:
                raise ValueError(f"{resource!r} is not a resource name: {problem}")
        twice = sorted({r for r in value if value.count(r) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice; name each resource once")
        return value

    @field_validator("kubelet_root")
    @classmethod
    def _absolute_root(cls, value: Path) -> Path:
        problem = path_problem(value)
        if problem is not None:
            raise ValueError(f"{problem} (the kubelet's --root-dir, e.g. /var/lib/kubelet)")
        return value


class Settings(StrictModel):
    kubelet_dir: Path = DEFAULT_KUBELET_DIR
    cdi: CdiSettings = CdiSettings()
    # Where /metrics, /healthz and /readyz are served; None: not at all.
    metrics_address: str | None = None
    log_format: LogFormat | None = None
    log_level: LogLevel = "info"
    hotplug: HotplugSettings = HotplugSettings()
    # Resources served through DRA rather than the device plugin API; None: none.
    dra: DraSettings | None = None
    # The longest a stop may take in all, from the stop signal: stop hooks, CDI clean-up,
    # worker threads. Past it the process exits anyway. Below a pod's 30 s grace period.
    stop_timeout_s: float = Field(default=20.0, gt=0, le=3600)
    # scanner name (its one spelling: intel_gpu) -> its raw section; validated by
    # devplug.scanners.registry.
    scanners: dict[str, Any] = Field(default_factory=dict)
    # The scanner names that load_settings was given in the other spelling (intel-gpu): the
    # hints are logged by whoever configures logging, after the settings are read.
    _respellings: tuple[Respelling, ...] = PrivateAttr(default=())

    @property
    def scanner_respellings(self) -> tuple[Respelling, ...]:
        return self._respellings

    # What a running daemon set up once and cannot change on SIGHUP: its sockets' dir, the
    # CDI dir and its lock, the HTTP listener, the logging pipeline, which front serves what.
    RESTART_ONLY: ClassVar[tuple[str, ...]] = (
        "kubelet_dir",
        "cdi",
        "dra",
        "log_format",
        "log_level",
        "metrics_address",
    )

    def restart_only_changes(self, new: Settings) -> list[str]:
        """The restart-only settings ``new`` changes (a reload keeps this config's values)."""
        return [name for name in self.RESTART_ONLY if getattr(new, name) != getattr(self, name)]

    def reloaded(self, new: Settings) -> Settings:
        """``new``, with this config's restart-only settings kept."""
        return new.model_copy(update={name: getattr(self, name) for name in self.RESTART_ONLY})

    @model_validator(mode="after")
    def _dra_needs_cdi(self) -> Self:
        if self.dra is not None and not self.cdi.enabled:
            # Raised as it is (pydantic wraps only ValueError): it names the setting to change.
            raise ConfigError(
                "cdi.enabled",
                "must be true with a dra section: DRA's Prepare answers with the ids of "
                "devplug's CDI specs; turn CDI on, or leave the dra section out",
            )
        return self

    @field_validator("metrics_address")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value

    @field_validator("kubelet_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        problem = path_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


# Flags and environment variables that map onto top-level settings.
SCALAR_KEYS = ("kubelet_dir", "cdi_dir", "log_format", "log_level", "metrics_address")


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Top-level settings given as DEVPLUG_<KEY> environment variables."""
    found: dict[str, Any] = {}
    for key in SCALAR_KEYS:
        value = environ.get(ENV_PREFIX + key.upper())
        if value:
            found[key] = value
    return found


def env_scanners(environ: Mapping[str, str]) -> list[str]:
    """DEVPLUG_SCANNER: comma-separated scanner names, as given."""
    raw = environ.get(ENV_PREFIX + "SCANNER", "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def load_settings(
    config_file: Path | None,
    flags: Mapping[str, Any] | None = None,
    scanner_names: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    *,
    config_source: str = "--config",
) -> Settings:
    """Merge file, environment and flags (later wins) and validate; ConfigError names the bad
    field, or the variable or flag a bad value came from (``DEVPLUG_LOG_LEVEL``,
    ``--kubelet-dir``). A missing ``config_file`` is an error; None reads none.
    ``config_source`` is what named the file (``--config`` or ``DEVPLUG_CONFIG``), for errors.

    ``scanner_names`` (from --scanner) and DEVPLUG_SCANNER add scanners with their defaults
    unless the file already configures them. A scanner name is written ``intel_gpu``; one
    given as ``intel-gpu`` (a flag, the variable or a file key) is accepted, and noted in
    :attr:`Settings.scanner_respellings` for a hint.
    """
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = (
        read_config_file(config_file, config_source) if config_file is not None else {}
    )
    from_env = env_overrides(environ)
    from_flags = {key: value for key, value in (flags or {}).items() if value is not None}
    sources = {key: ENV_PREFIX + key.upper() for key in from_env}
    sources.update({key: "--" + key.replace("_", "-") for key in from_flags})
    if "cdi_dir" in sources:
        sources["cdi.dir"] = sources.pop("cdi_dir")
    raw.update(from_env)
    raw.update(from_flags)
    if "cdi_dir" in raw:
        # --cdi-dir, DEVPLUG_CDI_DIR and a top-level cdi_dir key all set cdi.dir.
        cdi = raw.get("cdi")
        if cdi is None:
            cdi = {}
        if not isinstance(cdi, dict):
            raise ConfigError("cdi", "must be a mapping of CDI settings")
        cdi["dir"] = raw.pop("cdi_dir")
        raw["cdi"] = cdi
    respellings: list[Respelling] = []
    if isinstance(raw.get("scanners"), dict):
        raw["scanners"] = _file_sections(raw["scanners"], respellings)
    given = [("DEVPLUG_SCANNER", name) for name in env_scanners(environ)]
    given += [("--scanner", name) for name in scanner_names]
    if given:
        scanners = raw.get("scanners")
        if scanners is None:
            scanners = {}
        if not isinstance(scanners, dict):
            raise ConfigError("scanners", "must be a mapping of scanner name -> settings")
        for source, name in given:
            if scanner_name(name) != name:
                respellings.append(Respelling(source, name, scanner_name(name)))
            scanners.setdefault(scanner_name(name), None)
        raw["scanners"] = scanners
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as exc:
        raise config_error(exc, model=Settings, sources=sources) from None
    settings._respellings = tuple(respellings)
    return settings


def _file_sections(sections: dict[Any, Any], respellings: list[Respelling]) -> dict[Any, Any]:
    """The file's scanner sections under each name's one spelling; a key in the other is
    noted, and two keys naming one scanner are refused (which one would win is a guess)."""
    named: dict[Any, Any] = {}
    written: dict[str, str] = {}  # name -> the key the file wrote it as
    for key, section in sections.items():
        if not isinstance(key, str):
            named[key] = section  # refused by the model, naming it
            continue
        name = scanner_name(key)
        if name in written:
            raise ConfigError(
                f"scanners.{key}",
                f"names the same scanner as scanners.{written[name]}; keep one section, "
                f"scanners.{name}",
            )
        if name != key:
            respellings.append(Respelling(f"scanners.{key}", key, name))
        written[name] = key
        named[name] = section
    return named
