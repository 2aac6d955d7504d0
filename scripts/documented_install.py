"""Runs a backend's documented install as written, in a fresh venv, and then `diloco` past the
launcher's checks, so an install line that is not enough fails the build, not a user.

A user copies the install from whichever page they read first: the top README's "On <Backend>",
the backend's own README, or the example spec's header. Every page must give the same commands
(checked here first, in one line naming the page that differs). The required commands are
followed by a `diloco dryrun` of the example: the dry run plans the run, which packs the
launcher's diloco as wheels (`diloco.shipping.wheelhouse`), the step that fails when diloco-replica is
missing. With --optional, the lines whose comment says "optional" (SageMaker's `images` extra)
run next, with a dry run of the path they are for; they are left out by default because
sagemaker-core pulls pandas and scipy (half a minute of installing, a build must stay quick).

pip is pointed at the freshly built wheels by PIP_FIND_LINKS, standing in for the index the user
installs diloco from; the commands themselves run unchanged (`bash -c`, the venv first on PATH).

    python3 scripts/documented_install.py modal --venv /tmp/v                     # scripts/build (wheels in dist/)
    python3 scripts/documented_install.py sagemaker --venv /tmp/v --optional      # also the optional lines
    python3 scripts/documented_install.py sagemaker                               # print the commands
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITLES = {"modal": "Modal", "sagemaker": "SageMaker"}
# The launcher side must never pull torch: replicas run it, the launcher only packs diloco.
NEVER_INSTALLED = ("torch",)
# The example's secrets must be set for a dry run; their values never leave this machine in one.
DUMMY_ENV = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1"}


def _bash_block(markdown: str, after: str = "") -> list[str]:
    """The lines of the first ```bash block after the line `after` (the top of the file if empty)."""
    start = markdown.index(after) if after else 0
    found = re.search(r"^```bash\n(.*?)^```", markdown[start:], re.S | re.M)
    return found[1].splitlines() if found else []


def sources(backend: str) -> dict[str, list[str]]:
    """{page: its install lines} for every page that tells a user how to install `backend`."""
    example = f"examples/tiny-lm/diloco-{backend}.toml"
    package = f"packages/backend-{backend}/README.md"
    return {
        "README.md": _bash_block((ROOT / "README.md").read_text(), f"## On {TITLES[backend]}\n"),
        package: _bash_block((ROOT / package).read_text()),
        example: [line.lstrip("#") for line in (ROOT / example).read_text().splitlines() if line.startswith("#")],
    }


def pip_commands(lines: list[str]) -> tuple[list[str], list[str]]:
    """(required, optional) `pip install` commands in shell lines, each as one normalized command
    (a line's `&&` parts split, its comment dropped; optional: the comment says so)."""
    required: list[str] = []
    optional: list[str] = []
    for line in lines:
        if "pip install" not in line:
            continue
        words = shlex.split(line)
        comment = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))
        into = optional if "optional" in " ".join(words[comment:]).lower() else required
        command: list[str] = []
        for word in [*words[:comment], "&&"]:
            if word != "&&":
                command.append(word)
                continue
            if command[:2] == ["pip", "install"]:
                into.append(shlex.join(command))
            command = []
    return required, optional


def documented(backend: str) -> tuple[list[str], list[str]]:
    """The required commands every page gives (SystemExit naming a page that differs), and the optional ones."""
    pages = {page: pip_commands(lines) for page, lines in sources(backend).items()}
    (first, (want, _)), *rest = pages.items()
    for page, (got, _) in rest:
        if got != want:
            raise SystemExit(f"error: {page} installs the {backend} launcher with {got}, {first} with {want}: "
                             f"every page must give the same commands")
    optional = list(dict.fromkeys(c for _, opt in pages.values() for c in opt))
    return want, optional


def _dryrun_specs(backend: str, tmp: Path) -> tuple[Path, Path | None]:
    """The example spec, and the spec of the optional path (SageMaker's official image, which ships
    the launcher's diloco as wheels), kept next to the example's code."""
    example = ROOT / "examples" / "tiny-lm" / f"diloco-{backend}.toml"
    if backend != "sagemaker":
        return example, None
    text, found = re.subn(r'(?m)^image = .*$', 'pytorch_version = "2.8"', example.read_text())
    if not found:
        raise SystemExit(f"error: {example.name} names no `image` to swap for pytorch_version")
    official = tmp / "official-image.toml"
    official.write_text(f'workdir = "{example.parent}"\n' + text)
    return example, official


def check(backend: str, venv: Path, find_links: Path, with_optional: bool = False) -> None:
    """Run the documented commands in `venv`, a dry run after the required and after the optional
    ones, and check torch stayed out (see the module docstring)."""
    required, every_optional = documented(backend)
    optional = every_optional if with_optional else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MODAL_"))}
    env |= DUMMY_ENV | {"PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": str(venv),
                        "PIP_FIND_LINKS": str(find_links.resolve()), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with tempfile.TemporaryDirectory(prefix="diloco-documented-") as tmp:
        env["DILOCO_STATE_DIR"] = str(Path(tmp) / "state")
        example, official = _dryrun_specs(backend, Path(tmp))
        for commands, spec in ((required, example), (optional, official)):
            if not commands:
                continue
            for command in commands:
                print(f"+ {command}", flush=True)
                _run(["bash", "-c", command], env, command)
            _run([str(venv / "bin" / "diloco"), "dryrun", str(spec)], env, f"diloco dryrun {spec.name}")
        code = f"import importlib.util as u; print(*[m for m in {NEVER_INSTALLED!r} if u.find_spec(m)])"
        pulled = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                                check=True).stdout.split()
        if pulled:
            raise SystemExit(f"error: the documented {backend} install pulled {', '.join(pulled)} next to the launcher")
    skipped = len(every_optional) - len(optional)
    print(f"documented {backend} install: {len(required) + len(optional)} commands run as written, dry runs pass"
          + (f" ({skipped} optional left out: --optional)" if skipped else ""))


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if "is ignored" not in line)[-3000:]
        raise SystemExit(f"{tail}\nerror: `{what}` failed in a fresh venv after the documented install "
                         f"(exit {done.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=sorted(TITLES))
    parser.add_argument("--venv", type=Path, help="a fresh venv to install into and check (else: print the commands)")
    parser.add_argument("--find-links", type=Path, default=ROOT / "dist", help="where the built wheels are")
    parser.add_argument("--optional", action="store_true", help="also run the optional lines (slow: see above)")
    args = parser.parse_args()
    if args.venv is None:
        required, optional = documented(args.backend)
        print("\n".join([*required, *(f"{c}  # optional" for c in optional)]))
        return
    check(args.backend, args.venv, args.find_links, args.optional)


if __name__ == "__main__":
    main()
