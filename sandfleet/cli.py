"""`sandfleet`: the sandbox fleet's command line."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import click

# What each runtime and provider needs from the machine: (kind, name, why).
REQUIREMENTS = (
    ("runtime local", "bwrap", "bubblewrap sandboxes"),
    ("runtime local", "mkfs.ext4", "each sandbox's disk quota (an ext4 upper layer)"),
    ("runtime local", "nsenter", "the verifier beside a sandbox"),
    ("runtime local", "setpriv", "the verifier as the sandbox's uid"),
    ("runtime apptainer", "apptainer", "instance start/exec/stop on clusters"),
    ("images", "mksquashfs", "pack image root filesystems"),
    ("images", "siftool", "wrap squashfs as SIF"),
    ("images", "debootstrap", "bootstrap local base images"),
    ("provider slurm", "sbatch", "submit worker jobs"),
    ("provider slurm", "squeue", "poll worker jobs"),
    ("provider slurm", "scancel", "release worker jobs"),
)


def machine_report() -> dict:
    """Which sandbox runtimes and fleet providers this machine can use, and why not."""
    from sandfleet.runtime.apptainer_setup import find_apptainer
    from sandfleet.runtime.apptainer_setup import report as apptainer_report

    tools = {name: shutil.which(name) for _, name, _ in REQUIREMENTS}
    tools["apptainer"] = find_apptainer()
    apptainer = apptainer_report()
    filesystems = Path("/proc/filesystems").read_text() if Path("/proc/filesystems").exists() \
        else ""
    return {
        "tools": tools,
        "overlayfs": "overlay" in filesystems,
        "fuse": Path("/dev/fuse").exists(),
        "slurm_conf": os.environ.get("SLURM_CONF"),
        "runtimes": {
            "local": os.geteuid() == 0 and all(tools[n] for n in ("bwrap", "mkfs.ext4",
                                                                  "nsenter", "setpriv")),
            "apptainer": apptainer["usable"],
        },
        "apptainer": apptainer,
        "providers": {"local": True,
                      "slurm": all(tools[n] for n in ("sbatch", "squeue", "scancel"))},
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Sandfleet: a Slurm-scaled fleet of sandboxes for agent rollouts."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command("doctor")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def doctor_cmd(output: str) -> None:
    """Report which runtimes and providers this machine supports."""
    report = machine_report()
    if output == "json":
        click.echo(json.dumps(report, indent=2))
        return
    for kind, name, why in REQUIREMENTS:
        path = report["tools"][name]
        click.echo(f"{'ok ' if path else 'no '} {kind:18} {name:12} {path or '-':28} {why}")
    click.echo(f"overlayfs: {'yes' if report['overlayfs'] else 'no'}   "
               f"/dev/fuse: {'yes' if report['fuse'] else 'no'}   "
               f"SLURM_CONF: {report['slurm_conf'] or '-'}")
    app = report["apptainer"]
    if app["usable"]:
        how = "rootless: --userns --fakeroot" if app["rootless"] else "as root"
        how += ", through the shipped tmax-apptainer wrapper" if app["wrapper"] else ""
        click.echo(f"apptainer {app['version']} ({how})")
        for line in app["not_enforced"]:
            click.echo(f"  apptainer does not enforce {line}")
        for line in app["not_guaranteed"]:
            click.echo(f"  apptainer does not guarantee {line}")
    else:
        click.echo(f"apptainer: not usable: {app['problem']}")
    usable = [k for k, v in {**report['runtimes']}.items() if v]
    click.echo(f"runtimes usable here: {', '.join(usable) or 'none'}; providers: "
               + ", ".join(k for k, v in report["providers"].items() if v))


# ---- the fleet: up, down, status, gc, worker (heavy modules import inside the commands)


def default_state_dir() -> Path:
    return Path(os.environ.get("SANDFLEET_STATE_DIR") or Path.home() / ".sandfleet")


state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=default_state_dir,
    show_default="$SANDFLEET_STATE_DIR or ~/.sandfleet",
    help="The fleet's state dir (on shared scratch for a Slurm fleet).")


def resolve_config(config_path: Path | None, provider: str | None, state_dir: Path):
    """--config, else the config a previous controller saved in the state dir, else the
    defaults; --provider overrides."""
    from sandfleet.config import FleetConfig, config_file, load_config

    if config_path is not None:
        try:
            config = load_config(config_file(config_path))
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="--config") from None
    elif (state_dir / "fleet.json").exists():
        config = FleetConfig.model_validate_json((state_dir / "fleet.json").read_text())
    else:
        config = load_config(None)
    return config.with_overrides(provider=provider) if provider else config


def _ask(state_dir: Path, message, timeout: float = 30.0) -> dict:
    import asyncio

    from sandfleet.discovery import read_controller_info
    from sandfleet.wire.transport import Connection

    info = read_controller_info(state_dir)
    if info is None:
        raise click.ClickException(f"no fleet in {state_dir} (no controller.json)")

    async def go() -> dict:
        conn = await Connection.open(info.address, info.token, timeout=5)
        try:
            result, _ = await conn.request(message, timeout=timeout)
            return result
        finally:
            await conn.close()

    return asyncio.run(go())


@main.command("up")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Fleet config (YAML path, or a shipped one's name: fleet, fleet-slurm); "
                   "default: the state dir's saved one, or defaults.")
@click.option("--provider", type=click.Choice(["slurm", "local"]), default=None,
              help="Override the config's provider.")
@state_dir_option
@click.option("--foreground", is_flag=True, help="Run the controller in this process.")
@click.option("--dry-run", is_flag=True,
              help="Print the resolved config and the exact worker job script; start nothing.")
@click.pass_context
def up_cmd(ctx: click.Context, config_path: Path | None, provider: str | None,
           state_dir: Path, foreground: bool, dry_run: bool) -> None:
    """Start the fleet's controller (it starts workers as leases are asked for)."""
    import subprocess
    import sys
    import time

    from sandfleet.controller import controller_alive
    from sandfleet.discovery import read_controller_info
    from sandfleet.providers import LocalProvider, SlurmProvider, make_provider, worker_argv

    state_dir = state_dir.absolute()
    config = resolve_config(config_path, provider, state_dir)
    if dry_run:
        click.echo(f"# resolved config\n{config.model_dump_json(indent=2)}\n")
        prov = make_provider(config, state_dir)
        if isinstance(prov, SlurmProvider):
            click.echo(f"# worker job script (worker w0)\n{prov.script('w0', 0)}")
        else:
            assert isinstance(prov, LocalProvider)
            click.echo("# worker command (worker w0)\n"
                       + " ".join(worker_argv(prov.python, state_dir, "w0")))
        return
    info = read_controller_info(state_dir)
    if controller_alive(info):
        click.echo(f"a controller already runs for {state_dir} at {info.address} "
                   f"(pid {info.pid})")
        return
    if foreground:
        from sandfleet.controller import serve_forever

        serve_forever(state_dir, config, make_provider(config, state_dir))
        return
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "logs").mkdir(exist_ok=True)
    verbosity = ["-v"] * max(1, ctx.parent.params.get("verbose", 0) if ctx.parent else 1)
    argv = [sys.executable, "-m", "sandfleet.cli", *verbosity, "up", "--foreground",
            "--state-dir", str(state_dir)]
    if config_path is not None:
        from sandfleet.config import config_file

        argv += ["--config", str(config_file(config_path).absolute())]
    if provider:
        argv += ["--provider", provider]
    log_path = state_dir / "logs" / "controller.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = read_controller_info(state_dir)
        if info is not None and info.pid == proc.pid:
            click.echo(f"sandfleet up: controller at {info.address} (pid {info.pid}, "
                       f"provider {config.provider}, state {state_dir})")
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    if proc.poll() is None:
        proc.kill()
    raise click.ClickException(f"the controller did not come up; {log_path}:\n{tail}")


def _offline_cleanup(state_dir: Path) -> list[str]:
    """Without a live controller: cancel the fleet's jobs (from its journal, and for Slurm
    this user's jobs named after this fleet), remove controller.json. The actions taken."""
    from sandfleet.controller.journal import JOURNAL, FleetDown, load, replay, rewrite
    from sandfleet.providers import SlurmProvider, make_provider

    done = []
    config = resolve_config(None, None, state_dir)
    provider = make_provider(config, state_dir)
    ids = set(replay(load(state_dir / JOURNAL)).jobs)
    if isinstance(provider, SlurmProvider):
        ids |= set(provider.own_jobs())
    states = provider.poll(sorted(ids)) or {}
    for job_id in sorted(ids):
        if states.get(job_id, "ended") != "ended":
            provider.cancel(job_id)
            done.append(f"cancelled job {job_id}")
    if (state_dir / "controller.json").exists():
        (state_dir / "controller.json").unlink()
        done.append("removed controller.json")
    if (state_dir / JOURNAL).exists():
        rewrite(state_dir / JOURNAL, [FleetDown()])
    return done


@main.command("config")
@click.argument("name", required=False)
def config_cmd(name: str | None) -> None:
    """Print a shipped fleet config (to copy and edit), or list them."""
    from sandfleet.config import config_file, shipped_configs

    if name is None:
        for shipped, path in sorted(shipped_configs().items()):
            click.echo(f"{shipped}\t{path}")
        return
    try:
        click.echo(config_file(name).read_text(), nl=False)
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="NAME") from None


@main.command("down")
@state_dir_option
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait.")
def down_cmd(state_dir: Path, timeout: float) -> None:
    """Release every lease, stop the workers, cancel the fleet's jobs, stop the controller."""
    import time

    from sandfleet.controller import controller_alive
    from sandfleet.discovery import read_controller_info
    from sandfleet.runtime.base import proc_start_time
    from sandfleet.wire.messages import Shutdown, new_id

    state_dir = state_dir.absolute()
    info = read_controller_info(state_dir)
    if controller_alive(info):
        try:
            _ask(state_dir, Shutdown(id=new_id(), reason="sandfleet down"), timeout=10)
        except Exception as e:  # noqa: BLE001 - fall through to the offline cleanup
            click.echo(f"controller did not answer ({e}); cleaning up offline", err=True)
        deadline = time.monotonic() + timeout
        while proc_start_time(info.pid) == info.pid_start and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc_start_time(info.pid) == info.pid_start:
            raise click.ClickException(f"controller pid {info.pid} still running after "
                                       f"{timeout:.0f}s")
        click.echo(f"sandfleet down: controller {info.address} stopped")
    for line in _offline_cleanup(state_dir):
        click.echo(line)


@main.command("status")
@state_dir_option
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def status_cmd(state_dir: Path, output: str) -> None:
    """Nodes, leases held and queued, recent failures by cause."""
    from sandfleet.wire.messages import Status, StatusReply, new_id, parse_result

    try:
        status = _ask(state_dir.absolute(), Status(id=new_id()), timeout=10)
    except (OSError, ConnectionError) as e:
        raise click.ClickException(f"controller unreachable: {e}") from None
    if output == "json":
        click.echo(json.dumps(status, indent=2))
        return
    st = parse_result(StatusReply, status)
    leases = st.leases
    click.echo(f"controller {st.address} (pid {st.pid}, provider {st.provider}, "
               f"up {st.uptime_s:.0f}s)")
    click.echo(f"leases: {leases.held} held, {leases.starting} starting, "
               f"{leases.queued} queued")
    click.echo(f"nodes: {len(st.nodes)}")
    for n in st.nodes:
        click.echo(f"  {n.worker_id:24} {n.state:9} {n.node:16} {n.address:22} "
                   f"{n.used_cpus}/{n.slots} cpus  {n.leases} leases  "
                   f"job {n.job_id or '-'}"
                   + (f"  ends in {n.ends_in_s / 60:.0f} min" if n.ends_in_s is not None
                      else ""))
    if st.jobs:
        click.echo("jobs: " + ", ".join(f"{j.job_id} ({j.name}, {j.state})" for j in st.jobs))
    click.echo("failures: " + (", ".join(f"{k} {v}" for k, v in st.failures.items())
                               or "none"))
    for f in st.recent_failures[-5:]:
        click.echo(f"  {f['cause']:14} {f.get('lease_id') or '-':24} {f['message'][:100]}")


@main.command("gc")
@state_dir_option
def gc_cmd(state_dir: Path) -> None:
    """Remove this user's orphans of a fleet: jobs and state when its controller is dead,
    and on this node the sandboxes and work dirs of workers that are gone. Safe from cron."""
    from sandfleet.controller import controller_alive
    from sandfleet.discovery import read_controller_info
    from sandfleet.worker import fleet_key, reap_dead_workers

    state_dir = state_dir.absolute()
    actions = []
    if not controller_alive(read_controller_info(state_dir)) and state_dir.exists():
        actions += _offline_cleanup(state_dir)
    config = resolve_config(None, None, state_dir)
    actions += reap_dead_workers(config.path("work_dir") / fleet_key(state_dir), config)
    if config.runtime == "local":
        from sandfleet.runtime.local import remove_unpacked_cache

        actions += remove_unpacked_cache(config.path("cache_dir"))
    for line in actions or ["nothing to collect"]:
        click.echo(line)


@main.command("worker")
@state_dir_option
@click.option("--name", default=None, help="Worker name (default: host-pid).")
def worker_cmd(state_dir: Path, name: str | None) -> None:
    """Run one worker (the entry point inside a node's job)."""
    import socket

    from sandfleet.worker import run_worker

    run_worker(state_dir.absolute(), name or f"{socket.gethostname()}-{os.getpid()}")


if __name__ == "__main__":
    main()
