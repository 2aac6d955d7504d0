"""Finding backends: pluggy over the ``diloco`` entry-point group, loaded on first use.

Nothing here runs at ``import diloco``; the first call to `backends()` builds the plugin
manager. Set DILOCO_DISABLE_PLUGIN_AUTOLOAD=1 to skip entry points (tests do, like
PYTEST_DISABLE_PLUGIN_AUTOLOAD) and DILOCO_PLUGINS=mod1,mod2 to register modules by name.
A plugin that fails to import is reported by `diloco backends`, not fatal to the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from dataclasses import dataclass

import pluggy

from typing import Any

from .. import hookspecs
from ..errors import BackendNotFound, SpecError, UserError
from ..options import BackendOption, describe_options, parse_options

ENTRY_POINT_GROUP = "diloco"
ENV_DISABLE_AUTOLOAD = "DILOCO_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "DILOCO_PLUGINS"
DEFAULT_PLUGINS = ("diloco.local.builtin",)
# Where first-party backends live, for the "not installed" hint.
KNOWN_BACKEND_PACKAGES = {
    "eks": "diloco-backend-eks",
    "modal": "diloco-backend-modal",
    "sagemaker": "diloco-backend-sagemaker",
}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    cls: type
    distribution: str
    version: str


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    distribution: str
    error: str


class _Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("diloco")
        self.pm.add_hookspecs(hookspecs)
        self.dist_of: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self.broken: list[BrokenPlugin] = []
        self._backends: dict[str, BackendInfo] | None = None

    def register(self, module: object, name: str, dist: str, version: str) -> None:
        if self.pm.has_plugin(name) or self.pm.is_registered(module):
            return
        self.pm.register(module, name=name)
        self.dist_of[name] = (dist, version)

    def load(self) -> None:
        core_version = md.version("diloco-core") if _installed("diloco-core") else "0+unknown"
        for mod in DEFAULT_PLUGINS:
            self.register(importlib.import_module(mod), mod, "diloco-core", core_version)
        if not os.environ.get(ENV_DISABLE_AUTOLOAD):
            for ep in md.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist else "?"
                version = ep.dist.version if ep.dist else "?"
                try:
                    module = ep.load()
                except Exception as exc:  # a broken plugin must not take the others down
                    self.broken.append(BrokenPlugin(ep.name, dist, f"{type(exc).__name__}: {exc}"))
                    continue
                self.register(module, f"{dist}:{ep.name}", dist, version)
        for mod in filter(None, (x.strip() for x in os.environ.get(ENV_PLUGINS, "").split(","))):
            try:
                module = importlib.import_module(mod)
            except ImportError as exc:
                raise UserError(f"{ENV_PLUGINS} names module {mod!r}, which does not import: {exc}") from None
            self.register(module, mod, mod, "local")
        self.pm.check_pending()

    def backends(self) -> dict[str, BackendInfo]:
        if self._backends is None:
            found: dict[str, BackendInfo] = {}
            for impl in self.pm.hook.diloco_register_executors.get_hookimpls():
                dist, version = self.dist_of.get(impl.plugin_name, (impl.plugin_name, "?"))
                for cls in impl.function() or []:
                    name = getattr(cls, "backend_name", None)
                    if not isinstance(name, str) or not name:
                        raise UserError(f"plugin {dist} registered {cls!r} without a backend_name")
                    missing = [a for a in ("Options", "capabilities", "plan", "submit") if not hasattr(cls, a)]
                    if missing:  # reported like a plugin that fails to import, not fatal to the others
                        self.broken.append(BrokenPlugin(name, dist, f"{cls.__name__} has no {', '.join(missing)} "
                                                                    f"(docs/writing-a-backend.md)"))
                        continue
                    if name in found and found[name].cls is not cls:
                        raise UserError(f"backend {name!r} is registered by both {found[name].distribution} "
                                        f"and {dist}; uninstall one of them")
                    found[name] = BackendInfo(name, cls, dist, version)
            self._backends = dict(sorted(found.items()))
        return self._backends


def backend_options(cls: type) -> list[BackendOption]:
    """The `[backend]` options a backend declares, for `diloco backends NAME` and the kit."""
    return describe_options(cls.Options)


def make_executor(cls: type, table: dict[str, Any], *, source: str = "<spec>") -> Any:
    """The one place an executor is built: from the spec's `[backend]` table (without `name`),
    checked against the backend's `Options` first, so a bad option is one `SpecError` line."""
    name = getattr(cls, "backend_name", "?")
    options = parse_options(cls.Options, table, source=source, backend=name)
    try:
        return cls(options)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{source}: [backend] options for {name!r}: {exc}") from None


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return False


_registry: _Registry | None = None


def registry() -> _Registry:
    global _registry
    if _registry is None:
        reg = _Registry()
        reg.load()
        _registry = reg
    return _registry


def reset() -> None:
    """Forget loaded plugins (tests; or after installing a package in-process)."""
    global _registry
    _registry = None


def get_plugin_manager() -> pluggy.PluginManager:
    return registry().pm


def backends() -> dict[str, BackendInfo]:
    return registry().backends()


def broken_plugins() -> list[BrokenPlugin]:
    return list(registry().broken)


def get_backend(name: str) -> BackendInfo:
    found = backends()
    if name in found:
        return found[name]
    installed = ", ".join(found) or "none"
    broken = [b for b in registry().broken if b.name == name]
    if broken:
        raise BackendNotFound(f"backend {name!r} from {broken[0].distribution} failed to load: {broken[0].error}")
    package = KNOWN_BACKEND_PACKAGES.get(name)
    if package:
        raise BackendNotFound(f"backend {name!r} is not installed: pip install {package} (installed: {installed})")
    raise BackendNotFound(f"backend {name!r} is not installed (installed: {installed}); a backend is a package "
                          f"with an entry point in group {ENTRY_POINT_GROUP!r}")
