"""The corpus's cache of upstream files: a file is used only when its sha256 is the manifest's,
a patch applies exactly or not at all, and a client whose files are missing says how to get them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.clients import upstream
from tests.clients.upstream import Manifest, apply_patch, fill, missing

ORIGINAL = "a\nb\nc\nd\n"
PATCH = """--- a/f.py
+++ b/f.py
@@ -1,4 +1,5 @@
 a
-b
+B
+b2
 c
 d
"""


def test_every_client_names_its_commit_license_files_and_patches() -> None:
    names = upstream.names()
    assert {
        "nanogpt",
        "hf_run_clm",
        "lightning_transformer",
        "accelerate_clm",
        "accelerate_nlp",
    } <= set(names)
    for name in names:
        manifest = Manifest.load(name)
        assert len(manifest.commit) == 40 and manifest.license and manifest.files
        assert manifest.entry in {Path(f.path).name for f in manifest.files}
        # a client with no patch runs only as it is, under ``memtui run`` (litgpt's pretrain)
        assert not manifest.patches or "integration.patch" in manifest.patches
        for patch in manifest.patches:
            assert (upstream.CLIENTS / name / patch).is_file()


def test_a_patch_applies_exactly(tmp_path: Path) -> None:
    (tmp_path / "f.py").write_text(ORIGINAL)
    apply_patch(PATCH, tmp_path)
    assert (tmp_path / "f.py").read_text() == "a\nB\nb2\nc\nd\n"


def test_a_patch_whose_context_differs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f.py").write_text("a\nx\nc\nd\n")
    with pytest.raises(ValueError, match=r"f\.py:2: the patch expects 'b"):
        apply_patch(PATCH, tmp_path)


def test_a_missing_or_different_file_is_not_used_and_the_reason_says_how_to_fill_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = tmp_path / "clients" / "toy"
    client.mkdir(parents=True)
    digest = hashlib.sha256(ORIGINAL.encode()).hexdigest()
    (client / "client.json").write_text(
        json.dumps(
            {
                "repository": "https://github.com/example/toy",
                "commit": "0" * 40,
                "license": "MIT",
                "files": [{"path": "src/f.py", "sha256": digest}],
                "entry": "f.py",
                "patches": ["integration.patch"],
            }
        )
    )
    (client / "integration.patch").write_text(PATCH)
    monkeypatch.setattr(upstream, "CLIENTS", tmp_path / "clients")
    monkeypatch.setenv("MEMTUI_CLIENTS_UPSTREAM", str(tmp_path / "cache"))
    manifest = Manifest.load("toy")
    reason = missing(manifest)
    assert reason and "is not there" in reason and "fill toy --from-git" in reason
    changed = tmp_path / "changed.py"
    changed.write_text(ORIGINAL + "# edited\n")
    with pytest.raises(SystemExit, match="sha256"):
        fill(manifest, None, str(changed))
    assert missing(manifest) == reason, "nothing was written"
    original = tmp_path / "f.py"
    original.write_text(ORIGINAL)
    assert fill(manifest, None, str(original)) == [tmp_path / "cache" / "toy" / "src" / "f.py"]
    assert missing(manifest) is None
    script = upstream.materialise(manifest, tmp_path / "run")
    assert script.read_text() == "a\nB\nb2\nc\nd\n"
    (tmp_path / "cache" / "toy" / "src" / "f.py").write_text(ORIGINAL + "# edited\n")
    assert "sha256 differs" in (missing(manifest) or "")
