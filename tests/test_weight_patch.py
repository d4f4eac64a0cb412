"""Patching fused weights into a converted base: exact where it can be, refused where it cannot."""

from __future__ import annotations

import numpy as np
import pytest

from adapterpack.weight_patch import WEIGHTS, patch_weights


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A converted two-layer program whose float16 weights we know."""
    from adapterpack.quiet import captured_output, import_coremltools

    ct = import_coremltools()
    from coremltools.converters.mil import Builder as mb

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 64)).astype(np.float16)
    w2 = rng.standard_normal((64, 64)).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=ct.converters.mil.mil.types.fp16)],
                opset_version=ct.target.iOS18)
    def program(x):
        return mb.linear(x=mb.linear(x=x, weight=w1), weight=w2)

    path = tmp_path_factory.mktemp("tpl") / "t.mlpackage"
    with captured_output():
        ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                   skip_model_load=True).save(str(path))
    return path, w1, w2


def run(path, x):
    from adapterpack.executor import ProgramExecutor

    executor = ProgramExecutor.load(path)
    return next(iter(executor.predict({"x": x}).values()))


def test_patched_copy_computes_with_the_new_weight(template, tmp_path):
    path, w1, w2 = template
    new = (w2.astype(np.float32) * -0.5).astype(np.float16)
    assert patch_weights(path, tmp_path / "p.mlpackage", [(w2, new)])
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float16)
    expected = (x.astype(np.float32) @ w1.T.astype(np.float32)).astype(np.float16).astype(np.float32) @ new.T.astype(np.float32)
    got = run(tmp_path / "p.mlpackage", x).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=5e-2)
    # the template itself is untouched
    assert (path / WEIGHTS).read_bytes() != (tmp_path / "p.mlpackage" / WEIGHTS).read_bytes()
    original = run(path, x).astype(np.float32)
    assert not np.allclose(original, got)


def test_unknown_weight_is_refused_and_leaves_nothing(template, tmp_path):
    path, _, _ = template
    stranger = np.ones((64, 64), np.float16)
    assert not patch_weights(path, tmp_path / "p.mlpackage", [(stranger, stranger * 2)])
    assert not (tmp_path / "p.mlpackage").exists()


def test_shape_or_dtype_change_is_refused(template, tmp_path):
    path, w1, _ = template
    assert not patch_weights(path, tmp_path / "p.mlpackage", [(w1, w1.astype(np.float32))])
    assert not patch_weights(path, tmp_path / "q.mlpackage", [(w1, w1[:32])])
