"""The names a call site's file goes by and which files are user or generated code
(pipeline/db/ingest/siting.py), rule by rule: portable names relative to the longest import root that
holds the file (never a sibling folder sharing its prefix), the roots a run's manifest gives, and the
generated-code folders that manifests name."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tbpipe.pipeline.db.ingest import siting

# ------------------------------------------------------------------------------------------ portable names


def test_a_file_is_named_from_the_longest_root_holding_it() -> None:
    roots = siting.import_roots({"sys_path": ["/srv", "/srv/app", "/srv/app/lib"]})
    assert siting.portable_file("/srv/app/lib/m.py", roots) == ("m.py", "/srv/app/lib")
    assert siting.portable_file("/srv/app/main.py", roots) == ("main.py", "/srv/app")


def test_a_sibling_folder_sharing_a_roots_prefix_is_not_under_it() -> None:
    assert siting.portable_file("/srv/app2/main.py", ["/srv/app"]) == ("/srv/app2/main.py", None)
    assert siting.portable_file("/srv/app", ["/srv/app"]) == ("/srv/app", None)


def test_installed_packages_are_named_from_their_site_packages_folder() -> None:
    lib = "/opt/venv/lib/python3.11/site-packages"
    assert siting.portable_file(f"{lib}/torch/nn/module.py", []) == ("torch/nn/module.py", lib)
    # The innermost such folder: a venv inside another's site-packages names from its own.
    nested = f"{lib}/tool/venv/lib/site-packages"
    assert siting.portable_file(f"{nested}/x.py", []) == ("x.py", nested)
    debian = "/usr/lib/python3/dist-packages"
    assert siting.portable_file(f"{debian}/numpy/core.py", []) == ("numpy/core.py", debian)
    # A root holding the file wins over the marker.
    assert siting.portable_file(f"{lib}/torch/nn/module.py", [f"{lib}/torch"]) == ("nn/module.py", f"{lib}/torch")


def test_pseudo_files_keep_their_names() -> None:
    for pseudo in ("<string>", "<frozen os>", "fx_generated.py"):
        assert siting.portable_file(pseudo, ["/srv"]) == (pseudo, None)


SEGMENT = st.sampled_from(["a", "b", "ab", "a.b", "site-packages"])
PATHS = st.lists(SEGMENT, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))


@settings(max_examples=200, deadline=None, database=None)
@given(file=PATHS, sys_path=st.lists(PATHS, max_size=5))
def test_portable_names_match_their_definition(file, sys_path) -> None:
    roots = siting.import_roots({"sys_path": sys_path})
    holding = [root for root in roots if os.path.commonpath([root, file]) == root and root != file]
    portable, root = siting.portable_file(file, roots)
    if holding:
        longest = max(holding, key=len)
        assert (portable, root) == (os.path.relpath(file, longest), longest)
    elif "/site-packages/" not in file:
        assert (portable, root) == (file, None)


# ------------------------------------------------------------------------------------------ import roots


def test_import_roots_are_sys_path_the_scripts_folder_and_the_working_folder_longest_first() -> None:
    # Folders normalized and deduplicated; relative entries, "/" and non-text dropped.
    manifest = {
        "sys_path": ["/srv/app/", "relative", "/", 7, "/opt/lib64", "/srv/app"],
        "cwd": "/home/u",
        "argv": ["tools/run.py"],
    }
    assert siting.import_roots(manifest) == ["/home/u/tools", "/opt/lib64", "/srv/app", "/home/u"]


def test_an_option_for_argv0_is_no_script_and_an_absolute_script_names_its_own_folder() -> None:
    assert siting.import_roots({"cwd": "/w", "argv": ["-c", "x"]}) == ["/w"]
    assert siting.import_roots({"cwd": "/w", "argv": [""]}) == ["/w"]
    assert siting.import_roots({"cwd": "/w", "argv": ["/opt/s/run.py"]}) == ["/opt/s", "/w"]
    assert siting.import_roots({"argv": ["run.py"]}) == []
    assert siting.import_roots({}) == []


# ------------------------------------------------------------------------------------------ generated code


def test_generated_code_folders_are_absolute_end_in_a_slash_and_the_first_manifest_names_them() -> None:
    manifests = [
        {"run_id": "r1", "generated_code": {"inductor": "/tmp/inductor", "triton": "relative", "x": 3}},
        {"run_id": "r2", "generated_code": {"inductor": "/tmp/inductor/", "triton": "/tmp/triton/"}},
        {"run_id": "r3", "generated_code": {"root": "/", "empty": ""}},
        {"run_id": "r4", "generated_code": None},
        {"run_id": "r5"},
    ]
    assert siting.generated_code_rows(manifests) == {
        "/tmp/inductor/": ("inductor", "r1"),
        "/tmp/triton/": ("triton", "r2"),
    }


def test_a_site_packages_folder_at_the_root_names_its_files_too() -> None:
    assert siting.portable_file("/site-packages/torch/nn.py", []) == ("torch/nn.py", "/site-packages")
    assert siting.portable_file("/dist-packages/np.py", []) == ("np.py", "/dist-packages")


def test_a_generated_folder_keeps_every_character_but_its_trailing_slashes() -> None:
    manifests = [{"run_id": "r", "generated_code": {"a": "/X", "b": "/cache/XX//", "c": "///"}}]
    assert siting.generated_code_rows(manifests) == {"/X/": ("a", "r"), "/cache/XX/": ("b", "r")}


# ------------------------------------------------------------------------------------------ lent '<string>' frames


def test_string_code_is_lent_to_its_caller_only_inside_generated_code() -> None:
    # Frames: 0 '<string>' code of the user, 1 a library's Python frame, 2 generated Python code.
    kinds = siting._FrameKinds(
        python=np.array([True, True, True]),
        user=np.array([True, False, False]),
        generated=np.array([False, False, True]),
        anonymous=np.array([True, False, False]),
        symbolized=np.array([True, True, True]),
        machinery=np.array([False, False, False]),
    )
    # Rows by stack, then depth: stack 1 runs '<string>' from the library inside generated code; stack 2
    # the same without generated code; stack 3 with the generated frame inside the '<string>' one.
    frame_of_row = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    row_stack = np.array([1, 1, 1, 2, 2, 3, 3, 3])
    row_depth = np.array([0, 1, 2, 0, 1, 0, 1, 2])
    lent = siting._lent_rows(frame_of_row, row_stack, row_depth, kinds)
    assert np.flatnonzero(lent).tolist() == [0]
