"""Plugin hooks. A backend package implements these and registers its module under the
entry-point group ``diloco``::

    # pyproject.toml of diloco-backend-foo
    [project.entry-points.diloco]
    foo = "diloco_foo.plugin"

    # diloco_foo/plugin.py
    from diloco import hookimpl

    @hookimpl
    def diloco_register_executors():
        from diloco_foo.executor import FooExecutor   # import the SDK lazily, not here
        return [FooExecutor]

The built-in local backend registers itself through the same hook.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("diloco")
hookimpl = pluggy.HookimplMarker("diloco")


@hookspec
def diloco_register_executors() -> list[type]:
    """Return executor classes this plugin provides.

    Each class implements :class:`diloco.protocol.Executor` (``plan`` / ``submit`` and the four
    verbs), declares ``capabilities`` and its ``[backend]`` options as ``Options`` (a dataclass of
    :func:`diloco.options.option` fields), and is selected by its ``backend_name`` class attribute.
    A class missing any of them, or two plugins returning the same name, is an error naming the
    distribution. Core builds it as ``cls(options)``, ``options`` an ``Options`` instance checked
    against the spec's ``[backend]`` table (``diloco.plugins.discovery.make_executor``).

    Keep this hook cheap: return classes, do not import cloud SDKs or contact any API.
    """


@hookspec
def diloco_register_metric_sinks() -> list[type]:
    """Return metric sink classes this plugin provides (see `diloco.plugins.sinks`).

    Each class has a ``sink_name``; a spec's ``[metrics] sinks`` picks sinks by that name and
    ``[metrics.<name>]`` gives its keyword options. The launcher calls ``write(summary)`` with
    each new `diloco.store.metrics.RoundSummary` and ``close()`` at the end. Import SDKs (mlflow,
    wandb) inside the class, not at module level.
    """
