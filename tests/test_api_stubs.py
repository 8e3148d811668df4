"""The committed gRPC stubs must be exactly what `make proto` generates from proto/."""

from pathlib import Path

from mmserve.protogen import OUT_DIR, generate


def test_regenerating_stubs_changes_nothing(tmp_path: Path):
    committed = {p.relative_to(OUT_DIR): p.read_text() for p in OUT_DIR.rglob("*_pb2*.py*")}
    assert committed, "no committed stubs found"
    fresh = {p.relative_to(tmp_path): p.read_text() for p in generate(tmp_path)}
    assert fresh.keys() == committed.keys()
    for name, text in fresh.items():
        assert text == committed[name], f"{name} is stale: run `make proto` and commit"


def test_stubs_import_and_describe_the_service():
    from mmserve.api import pb, pb_grpc

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in service.methods} == {"Generate", "Abort", "GetModelInfo", "GetServerLoad", "UploadMedia",
                                                      "Live"}
    assert service.methods_by_name["Generate"].server_streaming
    live = service.methods_by_name["Live"]
    assert live.client_streaming and live.server_streaming
    upload = service.methods_by_name["UploadMedia"]
    assert upload.client_streaming and not upload.server_streaming
    assert hasattr(pb_grpc, "GenerationServicer")
