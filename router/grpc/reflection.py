"""gRPC server reflection under both protocol versions (grpc.reflection.v1 and v1alpha), with
the API published as TGIS publishes it.

grpcio-reflection serves only v1alpha, while current clients (grpcurl, Postman, grpc_cli) ask
v1 first. The two protocols have the same messages under another package, so one servicer
answers both: its v1alpha messages go over the v1 method as they are. The servicer reads its
own descriptor pool, which holds every served file under the name clients expect: our generated
code registers the API as `router/pb/generation.proto` (the path that makes its imports package
members), but TGIS clients know it as `generation.proto`; and a v1 copy of the reflection file is
there so that v1 can be listed and described too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
METHOD = "ServerReflectionInfo"


def _file_proto(file: FileDescriptor, name: str) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    proto.name = name
    return proto


def _v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from v1alpha's (same messages, other package)."""
    proto = _file_proto(reflection_pb2.DESCRIPTOR, V1_FILE)
    alpha, v1 = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.package = V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # scalar fields must stay without one
                field.type_name = field.type_name.replace(alpha, v1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(alpha, v1)
            method.output_type = method.output_type.replace(alpha, v1)
    return proto


def enable_server_reflection(files: Sequence[tuple[FileDescriptor, str]], server: grpc.aio.Server) -> None:
    """Reflection over every service of `files` (each published under the name given with it)
    plus both reflection services, on v1 and v1alpha. The files must not import others."""
    pool = descriptor_pool.DescriptorPool()
    names: list[str] = []
    for file, name in files:
        pool.Add(_file_proto(file, name))
        names.extend(service.full_name for service in file.services_by_name.values())
    pool.Add(_file_proto(reflection_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR.name))
    pool.Add(_v1_reflection_file())
    names.extend((reflection.SERVICE_NAME, V1_SERVICE_NAME))
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(name, {METHOD: handler})
            for name in (reflection.SERVICE_NAME, V1_SERVICE_NAME)
        )
    )
