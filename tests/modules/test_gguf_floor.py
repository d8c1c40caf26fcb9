"""GGUF in and out (llama_cp/modules/gguf.py, llama_cp/train/gguf_export.py) run on transformers >= 5
and are refused below it in one line, before anything is read (Note [GGUF in])."""

import pytest
import transformers

from llama_cp.modules.gguf import GGUF_TRANSFORMERS_FLOOR, require_gguf

BELOW = int(transformers.__version__.split(".")[0]) < GGUF_TRANSFORMERS_FLOOR


def test_gguf_is_refused_below_transformers_5_and_admitted_from_it():
    if BELOW:  # the floors job (transformers 4.56.2)
        for what in ("a .gguf --model_name", "--format gguf"):
            with pytest.raises(ImportError) as refused:
                require_gguf(what)
            assert str(refused.value) == (
                f"{what} needs transformers>=5 (this is {transformers.__version__}, whose GGUF reader llama-cp is "
                "not tested with): pip install -U 'transformers>=5'")
    else:
        pytest.importorskip("gguf")
        assert require_gguf().GGUFWriter is not None
