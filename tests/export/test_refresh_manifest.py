"""What an export records for a later refresh: the attribute features, the digest, the copy map."""

from __future__ import annotations

import numpy as np
import onnx
from safetensors.numpy import load_file

from edge_client.refresh import derive_text
from edge_client.tensor_layout import onnx_initializer_spans, safetensors_layout
from fedmvp_formats.bundle_manifest import TEXT_FEATURES
from fedmvp_formats.promptformer import promptformer_digest


def test_manifest_promptformer_section_and_text_features(tiny_bundle, tiny_run):
    from export_helpers import rebuilt_model

    bundle, manifest = tiny_bundle.path, tiny_bundle.manifest
    checkpoint = load_file(str(tiny_run / "round-0002" / "global.safetensors"))
    section = manifest["promptformer"]
    assert section["digest"] == promptformer_digest(checkpoint)
    assert section["derive"] == "fedmvp-context-v1" and section["norm_context_eps"] == 1e-5
    assert manifest["source"]["run_id"] is None  # the test run records none
    assert manifest["files_by_role"]["text"] == "text_features.safetensors"
    weights = load_file(str(bundle / "weights.safetensors"))
    assert len(section["copy"]) == 12 and all(v.startswith("prompt.") for v in section["copy"].values())
    for source, target in section["copy"].items():  # the query side is stored as it is
        assert np.array_equal(weights[target], checkpoint[source]), source

    model, clip = rebuilt_model(tiny_run)
    features = load_file(str(bundle / "text_features.safetensors"))
    assert list(features) == [TEXT_FEATURES]
    expected = model.text_features.reshape(-1, model.text_features.shape[-1]).numpy()
    np.testing.assert_array_equal(features[TEXT_FEATURES], expected)  # what text_proj receives
    derived = derive_text(features[TEXT_FEATURES], checkpoint, section["norm_context_eps"])
    for name, value in derived.items():  # the device's derivation reproduces the exporter's constants
        np.testing.assert_allclose(value, weights[name], atol=1e-5, err_msg=name)


def test_tensor_layouts_match_the_onnx_and_safetensors_libraries(tiny_bundle):
    path = tiny_bundle.path / "model.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    spans = onnx_initializer_spans(path)
    data = path.read_bytes()
    embedded = [init for init in proto.graph.initializer if init.HasField("raw_data")]
    assert sorted(spans) == sorted(init.name for init in embedded)
    for init in embedded:
        span = spans[init.name]
        assert data[span.offset:span.offset + span.length] == init.raw_data and list(span.shape) == list(init.dims)
    layout = safetensors_layout(tiny_bundle.path / "weights.safetensors")
    raw = (tiny_bundle.path / "weights.safetensors").read_bytes()
    for name, value in load_file(str(tiny_bundle.path / "weights.safetensors")).items():
        span = layout[name]
        assert raw[span.offset:span.offset + span.length] == value.astype("<f4").tobytes()
