"""A Python client of ttt.v1 (Debian's python3-grpcio), from code generated off the project's .proto.

Usage: python3 python_client.py TARGET GENERATED_DIR < steps.json > results.json
Steps and results as in node/client.js.
"""
import json
import sys

target, generated = sys.argv[1], sys.argv[2]
sys.path.insert(0, generated)

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from ttt.v1 import ttt_pb2, ttt_pb2_grpc  # noqa: E402

channel = grpc.insecure_channel(target)
stub = ttt_pb2_grpc.TttServiceStub(channel)
REQUESTS = {
    "Generate": ttt_pb2.GenerateRequest,
    "CreateSession": ttt_pb2.CreateSessionRequest,
    "GetSession": ttt_pb2.GetSessionRequest,
    "DeleteSession": ttt_pb2.DeleteSessionRequest,
    "GetModelInfo": ttt_pb2.GetModelInfoRequest,
}


def run(step):
    call = step["call"]
    try:
        if call == "Health":
            # grpc.health.v1.Health/Check without its generated code (see node/client.js).
            check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=lambda x: x,
                                        response_deserializer=lambda x: x)
            raw = check(b"")
            return {"code": 0, "response": {"status": raw[1] if len(raw) == 2 else 0}}
        if call == "Reflection":
            # grpc.reflection.v1alpha list_services (field 7, empty) without generated code; the
            # answer names the services as plain strings.
            info = channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                request_serializer=lambda x: x, response_deserializer=lambda x: x)
            raw = next(info(iter([b"\x3a\x00"])))
            names = [n for n in ("ttt.v1.TttService", "grpc.health.v1.Health")
                     if n.encode() in raw]
            return {"code": 0, "response": {"services": names}}
        request = json_format.ParseDict(step["request"], REQUESTS[call]())
        if call == "Generate":
            tokens, finish = [], None
            for message in stub.Generate(request):
                tokens += [{"id": t.id, "text": t.text} for t in message.tokens]
                if message.HasField("usage"):
                    finish = ttt_pb2.FinishReason.Name(message.finish_reason)
            return {"code": 0, "tokens": tokens, "finish_reason": finish}
        response = getattr(stub, call)(request)
        return {"code": 0, "response": json_format.MessageToDict(
            response, preserving_proto_field_name=True)}
    except grpc.RpcError as error:
        return {"code": error.code().value[0], "message": error.details()}


steps = json.load(sys.stdin)
print(json.dumps([run(step) for step in steps]))
