"""``rayhf serve CHECKPOINT``: serve a Hugging Face checkpoint over an OpenAI-compatible API.

``app`` holds the one ``serve`` command. Mount it on the main CLI as a command, not a group
(``main_app.command("serve")(rayhf.serve.cli.serve)``), so the call is ``rayhf serve CKPT``
rather than ``rayhf serve serve CKPT``. Errors are ``RayhfError``s, printed as one line by
``rayhf.cli.main``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rayhf.errors import RayhfError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def serve(
    checkpoint: Annotated[str, typer.Argument(help="Hugging Face model directory (e.g. actor/)")],
    host: Annotated[str, typer.Option(help="Interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    model_id: Annotated[
        str | None, typer.Option(help="Model id clients send; default: the directory name")
    ] = None,
    max_batch_size: Annotated[
        int,
        typer.Option(
            help="Prompts batched together; rows (prompts x n) decoded at once; a request's "
            "prompts x n, at most"
        ),
    ] = 16,
    batch_wait_timeout_s: Annotated[float, typer.Option(help="Wait for a batch to fill")] = 0.05,
    max_prompt_tokens: Annotated[int, typer.Option(help="Longest prompt accepted")] = 512,
    max_tokens: Annotated[int, typer.Option(help="Ceiling on a request's max_tokens")] = 256,
    default_max_tokens: Annotated[
        int, typer.Option(help="max_tokens of a request that gives none")
    ] = 16,
    num_replicas: Annotated[int, typer.Option(help="Model copies")] = 1,
    num_cpus: Annotated[float, typer.Option(help="CPUs (and torch threads) per replica")] = 1.0,
    engine: Annotated[
        str, typer.Option(help="native (CPU/GPU, this repo) or vllm (Ray Serve LLM, GPUs)")
    ] = "native",
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=DIR: serve the PEFT LoRA adapter in DIR beside the checkpoint; requests "
            "naming model NAME use it (repeat for more; vLLM's --lora-modules)",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="RAYHF_API_KEY",
            help="Requests to /v1 must send 'Authorization: Bearer KEY' (401 otherwise)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve CHECKPOINT at http://HOST:PORT/v1 (completions, chat) until Ctrl-C."""
    from rayhf.serve.app import serve_checkpoint
    from rayhf.serve.engine import IN_PROCESS, check_checkpoint  # here: it imports transformers

    if engine in IN_PROCESS:
        check_checkpoint(checkpoint)  # before Ray starts: a wrong path is a one-line error
    adapters = {}
    for given in adapter or []:
        name, sep, where = given.partition("=")
        if not sep or not name or not where:
            raise RayhfError(f"--adapter {given}: give NAME=DIR (a PEFT adapter directory)")
        adapters[name] = str(Path(where).resolve())  # the replica may run elsewhere
    typer.echo(f"serving {checkpoint} at http://{host}:{port}/v1 (Ctrl-C stops)")
    serve_checkpoint(
        checkpoint,
        host=host,
        port=port,
        model_id=model_id,
        max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_timeout_s,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        num_replicas=num_replicas,
        num_cpus=num_cpus,
        engine=engine,
        api_key=api_key,
        adapters=adapters,
    )
