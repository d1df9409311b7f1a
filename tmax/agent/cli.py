"""Agent commands: ``tmax serve-scripted`` (a scripted OpenAI-compatible server)."""

from __future__ import annotations

import click


@click.command("serve-scripted")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=0, show_default=True, help="Port (0: a free one).")
@click.option("--model", default=None, help="Model name to report (default: the script's, "
              "else 'scripted').")
def serve_scripted(script: str, host: str, port: int, model: str | None) -> None:
    """Serve SCRIPT (a JSON/YAML list of replies, see tmax.agent.scripted_server) as an
    OpenAI-compatible endpoint; prints its base URL and serves until Ctrl-C.

    Point a policy at it as openai:scripted@URL."""
    import signal
    import threading

    from tmax.agent.scripted_server import ScriptedServer

    kwargs = {"model": model} if model else {}
    stop = threading.Event()
    # explicit handlers: a process started in the background inherits SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with ScriptedServer.from_file(script, host=host, port=port, **kwargs) as server:
        click.echo(server.url)
        while not stop.wait(0.5):
            pass
        click.echo("stopped", err=True)
