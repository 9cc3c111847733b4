"""push: publish a finished conversion on the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from .. import publish
from ._options import Json, Private, Token, argument, option, print_json, token


def push(
    out: argument(Path, "OUT", "A complete fp8convert output directory."),
    repo_id: argument(str, "REPO_ID", "Hub repo to upload to (owner/name); created if needed."),
    private: Private = False,
    revision: option(str | None, "--revision BRANCH", "Branch to push to (created from main if needed).") = None,
    commit_message: option(str | None, "--commit-message TEXT", "Commit title.") = None,
    create_pr: option(
        bool,
        "--create-pr",
        "Open a pull request (against --revision, default main) instead of committing to the branch.",
    ) = False,
    hub_token: Token = None,
    json_out: Json = False,
):
    """Upload OUT to the Hub repo REPO_ID with its model card. Refuses an incomplete output; never
    uploads OUT/.fp8convert/. Rerunning an interrupted push resumes it. Uses --token, HF_TOKEN or the
    saved login.

    Examples:

      fp8convert push ./Qwen3-8B-FP8 me/Qwen3-8B-FP8

      fp8convert push ./llama-fp8 my-org/llama-fp8 --private --revision channel-scheme

      fp8convert push ./llama-fp8 their-org/llama-fp8 --create-pr       # a repo you may not write to directly
    """
    url = publish.push(out, repo_id, private, revision, commit_message, token(hub_token), create_pr)
    if json_out:
        print_json({"out": str(out), "repo_id": repo_id, "revision": revision, "pull_request": create_pr, "url": url})
    else:
        print(f"{'opened a pull request on' if create_pr else 'pushed ' + str(out) + ' to'} {repo_id}: {url}")
