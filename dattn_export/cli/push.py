"""`dattn-export push`: a converted folder published to the Hub."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import CONVERTED, resolve
from .common import examples


@click.command(
    short_help="Publish a converted folder to the Hugging Face Hub.",
    epilog=examples(
        "dattn-export push ./converted --repo-id me/my-dattn --dry-run",
        "dattn-export push ./converted --repo-id me/my-dattn --private --validation-report onnx/validation_report.json",
    ),
)
@click.argument("converted", type=click.Path(), metavar="CONVERTED")
@click.option("--repo-id", required=True, help="namespace/name on the Hub.")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", help="Branch to commit to (created from main when missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--commit-message", help="Commit message (default: says what was uploaded).")
@click.option(
    "--token",
    help="Hub token; default: HF_TOKEN or the stored login. Never printed or uploaded "
    "(prefer HF_TOKEN: command-line arguments are visible to other users of the machine).",
)
@click.option(
    "--dry-run", is_flag=True, help="List every file, size and hash and print the model card; contact nothing."
)
@click.option("--skip-verify", is_flag=True, help="Publish even if the folder does not verify.")
@click.option("--license", "license_", default="other", show_default=True, help="License for the model card.")
@click.option("--base-model", help="The base model for the model card (e.g. the LLM the model started from).")
@click.option(
    "--validation-report",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="validation_report.json of an ONNX export of this model: its table goes into the model card.",
)
def push(
    converted: str,
    repo_id: str,
    private: bool,
    revision,
    create_pr: bool,
    commit_message,
    token,
    dry_run: bool,
    skip_verify: bool,
    license_: str,
    base_model,
    validation_report,
):
    """Publish a converted folder to the Hugging Face Hub in one commit, with a model card and the model code."""
    converted = resolve(converted, "push", CONVERTED, hub=False)
    from ..stages.push import push as run_push
    from ..ui import out as stdout
    from ..ui import stage, summary_table

    with stage("verifying and publishing" if not dry_run else "verifying"):
        result = run_push(
            converted,
            repo_id,
            token=token,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
            dry_run=dry_run,
            skip_verify=skip_verify,
            license=license_,
            base_model=base_model,
            validation_report=validation_report,
        )
    total = sum(f.size for f in result.files)
    if dry_run:  # sha256sum's format, with sizes: compare with `sha256sum` or the Hub's LFS pointers
        click.echo(
            f"dry run: {len(result.files)} files, {total:,} bytes would be committed to {repo_id}; nothing contacted"
        )
        click.echo(f"{'sha256':<64}  {'bytes':>14}  file")
        for f in result.files:
            click.echo(f"{f.sha256}  {f.size:>14,}  {f.path_in_repo}")
        if rewritten := [f.path_in_repo for f in result.files if f.rewritten]:
            click.echo(f"{', '.join(rewritten)}: published without this machine's paths (towers as Hub ids or null)")
        click.echo("\nmodel card (README.md):\n" + result.card)
        return
    rows = [
        ("repo", result.repo_url),
        ("commit", result.commit_url or "-"),
        ("pull request", result.pr_url or "-"),
        ("files", f"{len(result.files)} ({total:,} bytes)"),
        ("verified", "skipped" if result.checks is None else "; ".join(c.detail for c in result.checks)),
    ]
    stdout.print(summary_table("dattn-export push", rows))
