"""Registration of the `spyglass.v1.Spyglass` gRPC service on Ray Serve's gRPC proxy (the Serve config's
`grpc_options.grpc_servicer_functions` names `add_SpyglassServicer_to_server` here).

Same handlers as the generated `protos.spyglass_pb2_grpc.add_SpyglassServicer_to_server`, with one difference:
bytes that do not parse as the request message (truncated or garbled protobuf, a string field that is not
valid UTF-8) do not end in grpc's generic `INTERNAL: Exception deserializing request!`. The request becomes an
empty message whose id field carries `MALFORMED` and the parse error, and the gateway answers
`INVALID_ARGUMENT` with that message. Imports only grpc and the stubs (the proxy process loads this).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from protos import spyglass_pb2 as pb

SERVICE = "spyglass.v1.Spyglass"
MALFORMED = "\x00malformed:"


def tolerant_parser(message_cls, marker_field: str | None) -> Callable[[bytes], object]:
    """`message_cls.FromString`, except that unparsable bytes give a marked empty message (or a plain empty one
    for messages without fields, whose content is ignored anyway)."""

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as e:
            msg = message_cls()
            if marker_field is not None:
                reason = str(e) or type(e).__name__
                if "utf-8" in reason.lower() or "utf8" in reason.lower():
                    reason = "a string field is not valid UTF-8"
                detail = f"the request is not a valid {message_cls.DESCRIPTOR.name} message: {reason}"
                setattr(msg, marker_field, MALFORMED + detail[:300])
            return msg

    return parse


def add_SpyglassServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name grpc tooling expects
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=tolerant_parser(pb.GenerateRequest, "request_id"),
            response_serializer=pb.GenerateChunk.SerializeToString,
        ),
        "GenerateOnce": grpc.unary_unary_rpc_method_handler(
            servicer.GenerateOnce,
            request_deserializer=tolerant_parser(pb.GenerateRequest, "request_id"),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=tolerant_parser(pb.AbortRequest, "request_id"),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health,
            request_deserializer=tolerant_parser(pb.HealthRequest, None),
            response_serializer=pb.HealthResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=tolerant_parser(pb.ModelInfoRequest, None),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


__all__ = ["MALFORMED", "SERVICE", "add_SpyglassServicer_to_server", "tolerant_parser"]
