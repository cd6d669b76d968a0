"""``rayhf k8s``: render KubeRay manifests for a run, and validate manifests offline.

Mounted by the main CLI with ``app.add_typer(rayhf.k8s.cli.app, name="k8s")``; user errors
(unreadable files, no CRDs, a bad ``--cluster``) are ``RayhfError``s for it to print as one line.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from rayhf.k8s.render import DEFAULT_IMAGE, STORAGE_DIR, render, write_manifests
from rayhf.k8s.schema import CRDSet, default_crd_dir
from rayhf.k8s.validate import DocumentReport, check_paths

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="KubeRay manifests: render them for a run, validate them offline.",
    pretty_exceptions_enable=False,
)


@app.command("render")
def render_command(
    config: Annotated[str, typer.Argument(help="Experiment YAML to train")],
    cluster: Annotated[str, typer.Option(help="NODESxGPUS[xTYPE] of GPU workers, e.g. 2x8xH100")],
    out: Annotated[Path, typer.Option(help="Directory to write the manifests to")],
    image: Annotated[str, typer.Option(help="Image with Ray 2.60 and rayhf")] = DEFAULT_IMAGE,
    checkpoint: Annotated[
        str | None, typer.Option(help="Actor checkpoint path in the pods; adds a RayService")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Object name; default: the config's name")
    ] = None,
    namespace: Annotated[str | None, typer.Option(help="Namespace of the objects")] = None,
    pvc: Annotated[
        str | None,
        typer.Option(help=f"PersistentVolumeClaim mounted at {STORAGE_DIR}; the run writes there"),
    ] = None,
) -> None:
    """Write a RayJob (train), a RayCluster (interactive) and with --checkpoint a RayService."""
    docs = render(
        config,
        cluster,
        image,
        checkpoint=checkpoint,
        name=name,
        namespace=namespace,
        storage_claim=pvc,
    )
    for path in write_manifests(docs, out):
        typer.echo(str(path))


def _summary(reports: list[DocumentReport]) -> str:
    validated = sum(1 for r in reports if r.skipped is None)
    skipped = Counter(r.kind or "empty file" for r in reports if r.skipped is not None)
    text = f"{validated} validated"
    if skipped:
        text += ", skipped " + ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items()))
    return text


@app.command("validate")
def validate_command(
    paths: Annotated[
        list[str], typer.Argument(help="Files, directories (kustomizations are built), - = stdin")
    ],
    crds: Annotated[
        Path | None,
        typer.Option(help=f"Directory of KubeRay CRD YAML files (default: {default_crd_dir()})"),
    ] = None,
) -> None:
    """Check manifests as the API server and KubeRay would; exit 1 if any is invalid."""
    reports = check_paths(paths, CRDSet.load(crds))
    by_source: dict[str, list[DocumentReport]] = {}
    for report in reports:
        by_source.setdefault(report.source, []).append(report)
    n_invalid = 0
    for source, group in by_source.items():
        errors = [f"{r.label}: {e}" if r.kind else e for r in group for e in r.errors]
        n_invalid += any(r.errors for r in group)
        if not errors:
            typer.echo(f"{source}: OK ({_summary(group)})")
        for error in errors:
            typer.echo(f"{source}: {error}")
    typer.echo(
        f"{len(by_source) - n_invalid} of {len(by_source)} sources valid ({_summary(reports)})"
    )
    if n_invalid:
        raise typer.Exit(1)
