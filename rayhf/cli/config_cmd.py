"""``rayhf config``: the resolved config of a run, and the JSON schema of every field.

``show`` prints what ``rayhf run CONFIG [overrides]`` would run with (every default filled in,
the overrides applied), as the run directory's ``config.yaml`` will hold it; ``schema`` writes
the JSON schema of the experiment config, which editors use to complete and check YAML files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
import yaml

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Show a resolved config or write the config's JSON schema.",
    pretty_exceptions_enable=False,
)


@app.command()
def show(
    config: Annotated[str, typer.Argument(help="Experiment YAML")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Config overrides, e.g. steps=5 batch_size=32")
    ] = None,
) -> None:
    """Print CONFIG with the overrides applied and every default filled in (YAML)."""
    import rayhf

    cfg = rayhf.load_config(config, overrides or [])
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def schema(
    out: Annotated[
        Path | None, typer.Option(help="Write the schema to this file instead of stdout")
    ] = None,
) -> None:
    """The experiment config's JSON schema (e.g. for yaml-language-server in an editor)."""
    from rayhf.config.experiment import config_json_schema

    text = json.dumps(config_json_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    typer.echo(f"wrote {out}")
