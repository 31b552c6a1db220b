"""The suite passes in a clone of any name: library code is found by the package's location, not a path's text."""

import os

import fake_cuda


def call_from(filename: str):
    """``fake_cuda._library_line()`` called from code that claims to live at ``filename``."""
    code = compile("line = library_line()", filename, "exec")
    scope = {"library_line": fake_cuda._library_line}
    exec(code, scope)
    return scope["line"]


def test_a_test_file_in_a_clone_named_torchtsp_is_not_library_code(tmp_path):
    clone_test = os.path.join(str(tmp_path), "torchtsp", "tests", "test_x.py")
    venv_torch = os.path.join(str(tmp_path), "torchtsp", ".venv", "lib", "torch", "functional.py")
    assert call_from(clone_test) == ""
    assert call_from(venv_torch) == ""


def test_library_frames_are_named_relative_to_the_package():
    import torchtsp

    inside = os.path.join(os.path.dirname(os.path.realpath(torchtsp.__file__)), "layers.py")
    assert call_from(inside).startswith("layers.py:1 ")
