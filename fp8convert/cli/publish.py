"""push: publish a finished conversion on the Hugging Face Hub."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import publish
from ._options import Private, token


def push(
    out: Annotated[Path, typer.Argument(help="A complete fp8convert output directory.", show_default=False)],
    repo_id: Annotated[str, typer.Argument(help="Hub repo to upload to (owner/name); created if needed.",
                                           show_default=False)],
    private: Private = False,
    revision: Annotated[Optional[str], typer.Option(
        "--revision", help="Branch to push to (created from main if needed).")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit title.")] = None,
):
    """Upload OUT to the Hub repo REPO_ID with its model card. Refuses an incomplete output; never
    uploads OUT/.fp8convert/. Rerunning an interrupted push resumes it. Uses HF_TOKEN or the saved login.

    Examples:

      fp8convert push ./Qwen3-8B-FP8 me/Qwen3-8B-FP8

      fp8convert push ./llama-fp8 my-org/llama-fp8 --private --revision channel-scheme
    """
    url = publish.push(out, repo_id, private=private, revision=revision, commit_message=commit_message, token=token())
    print(f"pushed {out} to {repo_id}: {url}")


def register(app: typer.Typer) -> None:
    app.command()(push)
