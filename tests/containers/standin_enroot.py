"""Stand-in for ``enroot start`` as pyxis calls it for each task (test-only): "run this command in that image".

    enroot start --step N --task T [--mount SRC:DST[:ro]]... [--workdir DIR] [--no-mount-home] IMAGE -- CMD...

As pyxis does for a PyTorch image, each task gets ``RANK`` / ``LOCAL_RANK`` from its SLURM_PROCID / SLURM_LOCALID.
No namespaces here: the task runs as a local process and the container's paths are mapped to host paths instead.
``$STANDIN_IMAGES`` (a JSON file) describes each image: ``paths`` (container path -> host path: the image's
``/opt/nemo_dapo``, built like ``COPY . /opt/nemo_dapo``), ``bin`` (a directory put first on PATH: the image's
``python``) and ``env`` (the image's ENV lines). Mount destinations and image paths are rewritten to their host
paths in the command's arguments and the working directory, at path boundaries only (``/results/x`` yes,
``/resultsx`` no). A container path that neither maps nor exists on the host would fail here as in a container.

Each task is recorded as ``$STANDIN_RECORDS/step<N>.task<T>.json``: image, mounts, workdir, the command as the
container saw it, the command as run, its environment and pid; then this process ``exec``s the command (the pid
stays the task's, so a test can kill "a server" by the recorded pid).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


def fail(msg: str) -> None:
    print(f"enroot (stand-in): {msg}", file=sys.stderr)
    sys.exit(2)


def parse(argv: list) -> dict:
    if not argv or argv[0] != "start" or "--" not in argv:
        fail(f"usage: enroot start [options] IMAGE -- COMMAND... (got {argv[:3]}...)")
    sep = argv.index("--")
    out = {"mounts": [], "workdir": None, "mount_home": True, "image": argv[sep - 1], "command": argv[sep + 1:]}
    opts = argv[1:sep - 1]
    i = 0
    while i < len(opts):
        key = opts[i]
        if key == "--no-mount-home":
            out["mount_home"] = False
            i += 1
        elif key in ("--step", "--task", "--mount", "--workdir") and i + 1 < len(opts):
            if key == "--mount":
                out["mounts"].append(opts[i + 1])
            else:
                out[key[2:]] = opts[i + 1]
            i += 2
        else:
            fail(f"unknown argument {key!r}")
    if not out["command"]:
        fail("no command after --")
    return out


def mount_table(mounts: list) -> list:
    """[(container path, host path, read_only)] from pyxis's SRC:DST[:FLAGS] entries."""
    table = []
    for m in mounts:
        parts = m.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            fail(f"mount {m!r} is not SRC:DST[:ro]")
        if not os.path.exists(parts[0]):
            fail(f"mount source {parts[0]!r} does not exist (pyxis fails the same way)")
        table.append((parts[1].rstrip("/") or "/", parts[0].rstrip("/") or "/",
                      len(parts) == 3 and "ro" in parts[2].split("+")))
    return table


def rewriter(mapping: list):
    """A function container-text -> host-text for [(container path, host path)] (longest container path first)."""
    pairs = sorted(((c, h) for c, h in mapping if c != h), key=lambda p: -len(p[0]))
    if not pairs:
        return lambda s: s
    alternation = "|".join(re.escape(c) for c, _ in pairs)
    pattern = re.compile(rf"(?<![\w.\-/])({alternation})(?=[/\s'\"\]\[,}}{{:;)]|$)")
    hosts = dict(pairs)
    return lambda s: pattern.sub(lambda m: hosts[m.group(1)], s)


def main(argv: list) -> None:
    args = parse(argv)
    images = json.loads(Path(os.environ["STANDIN_IMAGES"]).read_text())
    if args["image"] not in images:
        fail(f"no image {args['image']!r} (known: {sorted(images)}); pyxis would fail to import it")
    image = images[args["image"]]
    mounts = mount_table(args["mounts"])
    rewrite = rewriter([(c, h) for c, h, _ in mounts] + list(image.get("paths", {}).items()))
    command = [rewrite(a) for a in args["command"]]
    env = dict(os.environ)
    env.update(image.get("env", {}))
    env["PATH"] = f"{image['bin']}{os.pathsep}{env['PATH']}"
    # pyxis, for an image with PYTORCH_VERSION in its environment (both images: NGC PyTorch), sets these from the
    # task's own place in its step (pyxis_slurmstepd.c, pytorch_setup)
    env.update(RANK=env.get("SLURM_PROCID", "0"), LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
    workdir = rewrite(args["workdir"] or image.get("workdir") or os.getcwd())
    record = {"image": args["image"], "mounts": [{"container": c, "host": h, "ro": ro} for c, h, ro in mounts],
              "mount_home": args["mount_home"], "workdir": args["workdir"], "container_command": args["command"],
              "command": command, "env": env, "pid": os.getpid()}
    path = Path(os.environ["STANDIN_RECORDS"]) / f"step{args['step']}.task{args['task']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    os.chdir(workdir)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])
