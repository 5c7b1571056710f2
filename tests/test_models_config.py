"""hybridkv.models.config: text-config selection, dtype, defaults and typed field access."""

from __future__ import annotations

import pytest

from hybridkv.errors import ConfigError
from hybridkv.models.config import ConfigView, model_dtype, select_text_config
from hybridkv.specs import DType

SUPPORTED = {"gemma3_text": 1, "llama4_text": 1, "qwen3_next": 1}


def view(**data: object) -> ConfigView:
    return ConfigView("demo", data, {"with_default": 7, "nullable": 4096})


def test_select_text_config() -> None:
    flat = {"model_type": "qwen3_next", "text_config": {"model_type": "gemma3_text"}}
    assert select_text_config(flat, SUPPORTED) == ("qwen3_next", flat)
    wrapper = {"model_type": "gemma3", "torch_dtype": "float16", "text_config": {"hidden_size": 8}}
    model_type, text = select_text_config(wrapper, SUPPORTED)
    assert model_type == "gemma3_text"  # the wrapper's known text type
    assert text == {"hidden_size": 8, "torch_dtype": "float16"}  # dtype inherited
    own = {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "dtype": "bf16"}}
    assert select_text_config(own, SUPPORTED)[1]["dtype"] == "bf16"
    assert select_text_config({"model_type": "rwkv"}, SUPPORTED)[0] == "rwkv"
    with pytest.raises(ConfigError, match=r"config.model_type: missing"):
        select_text_config({"text_config": {"hidden_size": 8}}, SUPPORTED)


def test_model_dtype() -> None:
    assert model_dtype({}, "m") is DType.BF16
    assert model_dtype({"torch_dtype": "float32"}, "m") is DType.FP32
    assert model_dtype({"dtype": "float16", "torch_dtype": "float32"}, "m") is DType.FP16
    assert model_dtype({"dtype": None, "torch_dtype": "bfloat16"}, "m") is DType.BF16


def test_defaults_and_explicit_null() -> None:
    cfg = view(nullable=None, present=3)
    assert cfg.req_int("with_default") == 7  # absent: the default applies
    assert cfg.opt_int("nullable") is None  # explicit null beats the default
    assert cfg.req_int("present") == 3
    assert cfg.first_int("absent", "present") == 3
    assert cfg.opt_int("absent") is None
    with pytest.raises(ConfigError, match=r"demo config: missing required field 'absent' \(why\)"):
        cfg.req_int("absent", why="why")


def test_typed_getters_reject_bad_values() -> None:
    cfg = view(
        zero=0,
        flag="yes",
        name=3,
        ints=[1, "2"],
        strs=["a", 1],
        obj=[1],
        whole=4.0,
    )
    assert cfg.req_int("zero", minimum=0) == 0
    assert cfg.req_int("whole") == 4
    with pytest.raises(
        ConfigError, match=r"field 'zero' must be an integer in \[1, 2147483647\], got 0"
    ):
        cfg.req_int("zero")
    with pytest.raises(ConfigError, match=r"field 'flag' must be true or false, got 'yes'"):
        cfg.req_bool("flag", default=False)
    assert cfg.req_bool("absent", default=True) is True
    with pytest.raises(ConfigError, match=r"field 'name' must be a string, got 3"):
        cfg.opt_str("name")
    with pytest.raises(
        ConfigError, match=r"field 'ints\[1\]' must be an integer in \[0, 2147483647\], got '2'"
    ):
        cfg.opt_int_list("ints")
    with pytest.raises(ConfigError, match=r"field 'strs' must be a list of strings"):
        cfg.opt_str_list("strs")
    with pytest.raises(ConfigError, match=r"field 'obj' must be a JSON object, got \[1\]"):
        cfg.opt_mapping("obj")


@pytest.mark.parametrize("value", [2**31, 2**63, 10**30, 1e308])
def test_integer_fields_have_an_upper_bound(value: object) -> None:
    # Found by review: a 1e308 head_dim overflowed the planner's floats and a 2^63
    # max_position_embeddings overflowed len(range(...)) in `hybridkv models`; both ended in
    # tracebacks instead of a ConfigError naming the field.
    cfg = view(big=value, ok=2**31 - 1)
    assert cfg.req_int("ok") == 2**31 - 1
    with pytest.raises(ConfigError, match=r"field 'big' must be an integer in \[1, 2147483647\]"):
        cfg.req_int("big")
    with pytest.raises(ConfigError, match=r"field 'big\[0\]' must be an integer in \[0, "):
        view(big=[value]).opt_int_list("big")


def test_check_length() -> None:
    with pytest.raises(
        ConfigError, match=r"demo config: field 'x' has 1 entries but the model has"
    ):
        view().check_length("x", [1], 2)
