"""push: publish a complete output on the Hugging Face Hub, with its model card (never `.fp8convert/`)."""

from __future__ import annotations

import glob
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .formats import CompressedTensorsConfig, QuantizationConfig, read_quantization_config
from .options import REPO_ID, Scheme, python_spelling
from .output.card import TARGET_MARK, make_card, read_source_card
from .output.finalize import check_output_complete, foreign_entries
from .output.manifest import WORK_DIR, Manifest
from .source.hub import CARD_NAME, hub_error, with_retries


@dataclass
class Pushed:
    url: str  # the commit's, or the pull request's
    pull_request: bool  # one was opened (with create_pr, none is where OUT holds nothing the branch lacks)
    left_out: list[str]  # OUT's entries fp8convert did not write, not uploaded (directories end in '/')


@python_spelling
def push(
    out: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    create_pr: bool = False,
) -> Pushed:
    """Upload a complete output to `repo_id` (created if needed) with a model card naming it (generated when
    missing): the files fp8convert wrote, where its manifest lists them, so nothing a user put beside them
    is published unasked. Rerunning resumes an upload."""
    from huggingface_hub import HfApi

    out = Path(out)
    if not REPO_ID.match(repo_id):
        raise UsageError(f"{repo_id}: not a Hub repo id (owner/name)")
    config = check_output_complete(out)
    # a dequantized output has no quantization_config (its manifest says what it is)
    declared = read_quantization_config(config, str(out / "config.json")) if "quantization_config" in config else None
    card_path = out / CARD_NAME
    if card_path.is_file():  # a generated card's examples should name the repo, not the local directory
        text = card_path.read_text(encoding="utf-8")
        if (retargeted := retarget_card(text, repo_id)) != text:
            card_path.write_text(retargeted, encoding="utf-8")
    else:
        card_path.write_text(card_from_output(out, declared, repo_id), encoding="utf-8")
    left_out = foreign_entries(out) if Manifest(out).path.is_file() else []
    what = f"FP8 checkpoint ({declared.format})" if declared else "checkpoint dequantized from FP8"
    api = HfApi(token=token)
    try:
        with_retries(api.create_repo, repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            with_retries(api.create_branch, repo_id, branch=revision, exist_ok=True)
        # Top-level shards of an earlier push with other sharding would sit beside the new ones.
        stale = [
            f
            for f in with_retries(api.list_repo_files, repo_id, revision=revision)
            if "/" not in f and f.endswith(".safetensors") and not (out / f).is_file()
        ]
        info = with_retries(
            api.upload_folder,
            repo_id=repo_id,
            folder_path=str(out),
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message or f"{what} made with fp8convert",
            ignore_patterns=[WORK_DIR, f"{WORK_DIR}/*", "*.partial", ".*.tmp"]
            + [glob.escape(name) + ("*" if name.endswith("/") else "") for name in left_out],
            delete_patterns=stale or None,
        )
    except Exception as e:
        resume = "rerun the same push to resume it (files that arrived are not sent again)"
        raise hub_error(repo_id, e, revision, then=resume) from e
    if create_pr and getattr(info, "pr_url", None):
        return Pushed(info.pr_url, True, left_out)
    return Pushed(getattr(info, "commit_url", None) or str(info), False, left_out)


def retarget_card(text: str, repo_id: str) -> str:
    """A generated card with its examples naming `repo_id`; a card without the mark is left alone."""
    m = re.search(r"^" + re.escape(TARGET_MARK).replace(r"\{\}", "(.+?)") + r"\n?\Z", text, re.M)
    if not m:
        return text
    old = m.group(1)
    body = text[: m.start()].rstrip() + "\n"
    for before, after in (
        (f"vllm serve {shlex.quote(old)}\n", f"vllm serve {repo_id}\n"),
        (f"--model-path {shlex.quote(old)}\n", f"--model-path {repo_id}\n"),
        (f"from_pretrained({json.dumps(old)}", f"from_pretrained({json.dumps(repo_id)}"),
    ):
        body = body.replace(before, after)
    return body + "\n" + TARGET_MARK.format(repo_id) + "\n"


def card_from_output(out: Path, declared: QuantizationConfig | None, repo_id: str) -> str:
    """A card for a complete output that has none, from its manifest and its config's `declared` format."""
    manifest = Manifest(out).read() or {}
    declared = declared or CompressedTensorsConfig(Scheme.TENSOR)
    source = manifest.get("source") or "unknown"
    source_card = read_source_card(source) if Path(source).is_dir() else None
    info = {
        "source": source,
        "scheme": manifest.get("scheme") or declared.scheme,
        "format": manifest.get("format") or declared.format,
        "scale_format": manifest.get("scale_format") or declared.scale_format,
        "recipe": manifest.get("recipe") or [],
        "ignore": list(declared.ignore),
        "revision": manifest.get("revision"),
        "root": manifest.get("source_path"),
    }
    return make_card(info, source_card, repo_id=repo_id, base_model=manifest.get("base_model"))
