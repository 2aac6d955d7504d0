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

    Each class implements :class:`diloco.protocol.ServerlessExecutor` and is selected by its
    ``backend_name`` class attribute. Two plugins returning the same name is an error naming
    both distributions. Classes are instantiated with a spec's ``[backend]`` table as keyword
    arguments, so their ``__init__`` keyword parameters are the backend's options.

    Keep this hook cheap: return classes, do not import cloud SDKs or contact any API.
    """


@hookspec
def diloco_register_metric_sinks() -> list[type]:
    """Return metric sink classes this plugin provides (see `diloco.sinks`).

    Each class has a ``sink_name``; a spec's ``[metrics] sinks`` picks sinks by that name and
    ``[metrics.<name>]`` gives its keyword options. The launcher calls ``write(summary)`` with
    each new `diloco.metrics.RoundSummary` and ``close()`` at the end. Import SDKs (mlflow,
    wandb) inside the class, not at module level.
    """
