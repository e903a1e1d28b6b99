"""Compute kernels. Each op has a plain-torch reference here (the CPU path and the test oracle);
GPU implementations (Triton, flash-attn) sit beside it and are checked against it."""

from __future__ import annotations


def _give_the_name_back() -> None:
    """This folder is `pdserve.kernels`. A process started in the repository's root (`python -m`, pytest) also
    finds it as `kernels`: the name of Hugging Face's package, which transformers (>= 5.25 depends on it) imports
    at start. Give that name to the installed package, found on the rest of sys.path; where there is none, stay
    (transformers 5.24 imports the name to ask for its version, and takes a package without one as absent)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _give_the_name_back()
