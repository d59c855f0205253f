"""Operations through the real launcher: metrics after a scripted workload, gRPC health and
reflection, probes, TLS/mTLS, drain on SIGTERM, and a shard dying mid-generation."""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.parser import text_string_to_metric_families

from integration_tests.faults import long_params, outcomes_when, shard_processes
from integration_tests.servers import Server, launch
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc

logger = logging.getLogger(__name__)
STORY = "A very long story:\n"


def generate(stub, texts: list[str], **params) -> pb.BatchedGenerationResponse:
    return stub.Generate(
        pb.BatchedGenerationRequest(requests=[{"text": t} for t in texts], params=params or None)
    )


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    samples[("raw", ())] = text  # type: ignore[assignment]
    return samples


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.mktemp("ops"))


@pytest.fixture(scope="module")
def metrics_server(root) -> Iterator[Server]:
    s = launch("llama", root, "--max-concurrent-requests", "4")
    yield s
    s.stop()


def test_metrics_after_a_scripted_workload(metrics_server: Server) -> None:
    s = metrics_server
    stub = s.stub()
    stop = pb.StoppingCriteria
    generate(stub, [STORY], stopping=stop(max_new_tokens=5))  # MAX_TOKENS, single
    generate(stub, [STORY, "import os"], stopping=stop(max_new_tokens=3))  # MAX_TOKENS x2, batch
    list(stub.GenerateStream(pb.SingleGenerationRequest(request={"text": STORY})))  # MAX_TOKENS, stream
    with pytest.raises(grpc.RpcError):  # validation
        generate(stub, [STORY], method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.01))
    with pytest.raises(grpc.RpcError) as overload:  # 5 inputs > 4 permits
        generate(stub, [STORY] * 5)
    assert overload.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    eos = pb.DecodingParameters(length_penalty={"start_index": 2, "decay_factor": 10})
    assert generate(stub, [STORY], decoding=eos).responses[0].stop_reason == pb.EOS_TOKEN
    stopped = generate(stub, [STORY], stopping=stop(stop_sequences=["level"]))
    assert stopped.responses[0].stop_reason == pb.STOP_SEQUENCE
    assert (
        generate(stub, [" x" * 185], stopping=stop(max_new_tokens=100)).responses[0].stop_reason
        == pb.TOKEN_LIMIT
    )
    assert (
        generate(stub, [STORY], **{"stopping": long_params(20).stopping}).responses[0].stop_reason
        == pb.TIME_LIMIT
    )
    call = stub.GenerateStream(pb.SingleGenerationRequest(request={"text": STORY}, params=long_params()))
    next(call)
    next(call)
    call.cancel()
    stub.Tokenize(pb.BatchedTokenizeRequest(requests=[{"text": "a b"}, {"text": "c"}]))

    deadline = time.monotonic() + 10
    while True:
        m = scrape(s)
        settled = (
            m[("tgi_batch_current_size", ())] == 0
            and m[("tgi_request_failure_total", (("err", "cancelled"),))] == 1
            # the last decode call of a busy period can still be in flight when its
            # request's final response has already reached the client
            and all(
                m[("tgi_batch_inference_count_total", (("method", k),))]
                == m[("tgi_batch_inference_success_total", (("method", k),))]
                for k in ("prefill", "next_token")
            )
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def counter(name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        bare, total = m[(f"{name}_total", key)], m.get((name, key))
        raw = m[("raw", ())]
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        assert f"\n{name}{{{label_text}}} " in raw or f"\n{name} " in raw, f"bare twin of {name} missing"
        assert total is None or total == bare
        return bare

    assert {k: counter("tgi_request_count", kind=k) for k in ("single", "batch", "stream")} == {
        "single": 6,
        "batch": 2,
        "stream": 2,
    }
    assert counter("tgi_request_input_count") == 6 + 2 + 5 + 2
    failures = {
        e: counter("tgi_request_failure", err=e)
        for e in ("validation", "conc_limit", "cancelled", "generate", "timeout")
    }
    assert failures == {"validation": 1, "conc_limit": 1, "cancelled": 1, "generate": 0, "timeout": 0}
    expected_success = {
        ("MAX_TOKENS", "single"): 1,
        ("MAX_TOKENS", "batch"): 2,
        ("MAX_TOKENS", "stream"): 1,
        ("EOS_TOKEN", "single"): 1,
        ("STOP_SEQUENCE", "single"): 1,
        ("TOKEN_LIMIT", "single"): 1,
        ("TIME_LIMIT", "single"): 1,
    }
    for reason in (
        "MAX_TOKENS",
        "EOS_TOKEN",
        "STOP_SEQUENCE",
        "TOKEN_LIMIT",
        "TIME_LIMIT",
        "CANCELLED",
        "ERROR",
    ):
        for kind in ("single", "batch", "stream"):
            got = counter("tgi_request_success", stop_reason=reason, kind=kind)
            assert got == expected_success.get((reason, kind), 0), (reason, kind)
    successes = sum(expected_success.values())
    assert m[("tgi_request_duration_count", ())] == successes
    assert m[("tgi_request_generated_tokens_count", ())] == successes
    accepted = 9  # inputs that passed validation
    assert m[("tgi_request_input_length_count", ())] == accepted
    assert m[("tgi_request_raw_input_length_count", ())] == accepted  # the validation failure was a parameter
    assert m[("tgi_request_max_new_tokens_count", ())] == accepted
    assert m[("tgi_request_validation_duration_count", ())] == 8  # calls that validated
    assert m[("tgi_request_queue_duration_count", ())] == accepted
    assert m[("tgi_request_time_to_first_token_duration_count", ())] == accepted
    assert counter("tgi_tokenize_request_count") == 1 and counter("tgi_tokenize_request_input_count") == 2
    assert m[("tgi_tokenize_request_tokens_count", ())] == 1
    assert counter("tgi_queue_rejected", reason="conc_limit") == 1
    assert counter("tgi_request_cancellation", phase="running") == 1
    for method in ("prefill", "next_token"):
        calls = counter("tgi_batch_inference_count", method=method)
        assert calls > 0 and counter("tgi_batch_inference_success", method=method) == calls
        assert (
            m[("tgi_batch_inference_duration_count", (("makeup", "single_only"), ("method", method)))]
            == calls
        )
        forwards = m[
            ("tgi_batch_inference_forward_duration_count", (("makeup", "single_only"), ("method", method)))
        ]
        # one per forward: a prefill is one, a decode call may run several steps (MAX_DECODE_STEPS)
        assert forwards == calls if method == "prefill" else forwards >= calls
    assert m[("tgi_queue_size", ())] == 0 and m[("tgi_batch_max_remaining_tokens", ())] == 0


def test_the_router_knows_when_it_shares_the_shards_cpus(metrics_server: Server) -> None:
    """A shard computing on the CPU reports its CPUs (ModelInfo.compute_cpus); the router, on the
    same CPUs here, says so at start (its CPU time slows the forward: stream pacing can read it)."""
    log = metrics_server.log()
    on_cpu = re.search(r"INFO text_generation_server\.engines\.loading: loading .*; cpu\)", log)
    shared = "the shard computes on CPUs this router also runs on" in log
    assert shared == bool(on_cpu), log[-3000:]


def test_grpc_health_reflection_and_probes(metrics_server: Server) -> None:
    s = metrics_server
    channel = grpc.insecure_channel(s.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "fmaas.GenerationService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    # Reflection answers v1alpha and v1 (same messages, other package); the API's file is
    # published as TGIS clients know it.
    for version in ("v1alpha", "v1"):
        ask = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        listed, described = ask(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="fmaas.GenerationService"),
                ]
            )
        )
        names = {service.name for service in listed.list_services_response.service}
        assert {
            "fmaas.GenerationService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names, version
        (file,) = described.file_descriptor_response.file_descriptor_proto
        proto = descriptor_pb2.FileDescriptorProto.FromString(file)
        assert (proto.name, proto.package) == ("generation.proto", "fmaas"), version
        methods = [m.name for m in proto.service[0].method]
        assert methods == ["Generate", "GenerateStream", "Tokenize", "ModelInfo"]
    for path in ("/health", "/health/live", "/health/ready"):
        with urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}{path}", timeout=10) as r:
            assert r.status == 200, path


# ---- TLS --------------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str, key, issuer_cert=None, issuer_key=None, *, ca: bool = False, server: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        import ipaddress

        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture(scope="module")
def pki(root) -> dict[str, Path]:
    ca_key, other_key, server_key, client_key = _key(), _key(), _key(), _key()
    ca = _cert("test ca", ca_key, ca=True)
    other_ca = _cert("another ca", other_key, ca=True)
    server = _cert("localhost", server_key, ca, ca_key, server=True)
    client = _cert("a client", client_key, ca, ca_key)
    files = {
        "ca": _pem(ca),
        "other_ca": _pem(other_ca),
        "server_cert": _pem(server),
        "server_key": _pem(server_key),
        "client_cert": _pem(client),
        "client_key": _pem(client_key),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = root / f"{name}.pem"
        paths[name].write_bytes(data)
    return paths


def _model_info(server: Server, ca: Path, client: tuple[Path, Path] | None = None) -> pb.ModelInfoResponse:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None,
    )
    channel = grpc.secure_channel(f"localhost:{server.grpc_port}", credentials)
    try:
        return generation_pb2_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
    finally:
        channel.close()


def test_tls(root, pki) -> None:
    s = launch(
        "llama", root, env={"TLS_CERT_PATH": str(pki["server_cert"]), "TLS_KEY_PATH": str(pki["server_key"])}
    )
    try:
        assert _model_info(s, pki["ca"]).max_new_tokens == 169
        with pytest.raises(grpc.RpcError) as error:
            _model_info(s, pki["other_ca"])
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):  # plaintext to a TLS port
            s.stub().ModelInfo(pb.ModelInfoRequest(), timeout=5)
    finally:
        s.stop()


def test_mtls(root, pki) -> None:
    env = {
        "TLS_CERT_PATH": str(pki["server_cert"]),
        "TLS_KEY_PATH": str(pki["server_key"]),
        "TLS_CLIENT_CA_CERT_PATH": str(pki["ca"]),
    }
    s = launch("llama", root, env=env)
    try:
        with pytest.raises(grpc.RpcError) as error:  # no client certificate
            _model_info(s, pki["ca"])
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _model_info(s, pki["ca"], (pki["client_cert"], pki["client_key"])).max_sequence_length == 200
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TLS_CERT_PATH": "/nonexistent/cert.pem", "TLS_KEY_PATH": "/nonexistent/key.pem"},
            "couldn't load cert from /nonexistent/cert.pem",
        ),
        ({"TLS_CERT_PATH": "CERT"}, "tls: must provide both cert and key"),
    ],
)
def test_bad_tls_configuration_fails_with_one_line(root, pki, env: dict[str, str], message: str) -> None:
    env = {k: str(pki["server_cert"]) if v == "CERT" else v for k, v in env.items()}
    with pytest.raises(RuntimeError) as error:
        launch("llama", root, env=env)
    log = str(error.value)
    assert message in log and "Traceback" not in log


def test_int8_through_the_launcher(root) -> None:
    s = launch("llama@tgis_native", root, "--quantize", "int8")
    try:
        response = generate(s.stub(), ["def hello"], stopping={"min_new_tokens": 5, "max_new_tokens": 5})
        assert response.responses[0].generated_token_count == 5 and response.responses[0].text
        assert re.search(r"QUANTIZE=int8: \d+ linear layers in int8", s.log())
    finally:
        s.stop()
    with pytest.raises(RuntimeError) as error:
        launch("llama", root, "--quantize", "fp8")
    log = str(error.value)
    assert "QUANTIZE=fp8 runs on GPUs with fp8 tensor cores (Hopper" in log and "Traceback" not in log


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gptq_checkpoint_serves_through_the_launcher_without_the_flag(root, bits) -> None:
    from integration_tests.servers import model_dir
    from text_generation_server.testing.quantized_models import build_gptq
    from text_generation_server.testing.tiny_prompts import build_prompt_store

    name = "llama-gptq" if bits == 4 else f"llama-gptq{bits}"
    plain = model_dir("llama", root / "models")
    build_gptq(plain, root / "models" / name, group_size=32, act_order=True, bits=bits)
    prompts = root / "prompts" / name  # the plain model's soft prompts and adapters fit it
    if not (prompts / "nested").exists():
        build_prompt_store(plain, prompts)
    s = launch(f"{name}@tgis_native", root)
    try:
        response = generate(s.stub(), ["def hello"], stopping={"min_new_tokens": 5, "max_new_tokens": 5})
        assert response.responses[0].generated_token_count == 5 and response.responses[0].text
        assert (
            f"checkpoint quantization: gptq {bits}-bit weights, groups of 32, symmetric, act-order" in s.log()
        )
    finally:
        s.stop()
    if bits == 4:
        with pytest.raises(RuntimeError) as error:
            launch(name, root, "--quantize", "int8")
        log = str(error.value)
        assert (
            "QUANTIZE=int8 contradicts the checkpoint, which is quantized with gptq" in log
            and "Traceback" not in log
        )


# ---- drain and failures -----------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests(root) -> None:
    s = launch("llama", root)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address))

    async def running(n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while (await asyncio.to_thread(scrape, s)).get(("tgi_batch_current_size", ()), 0) < n:
            assert time.monotonic() < deadline, f"{n} requests never ran together"
            await asyncio.sleep(0.02)

    async def run() -> tuple[list, float]:
        stub = s.aio_stub()
        unary = [
            asyncio.ensure_future(
                stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": f"u{i}"}], params=long_params()))
            )
            for i in range(3)
        ]

        async def stream(i: int) -> list:
            return [
                m
                async for m in stub.GenerateStream(
                    pb.SingleGenerationRequest(request={"text": f"s{i}"}, params=long_params())
                )
            ]

        streams = [asyncio.ensure_future(stream(i)) for i in range(3)]
        await running(6)  # all six are in the batch
        s.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        # Health turns NOT_SERVING and new requests are refused while the six finish.
        status = None
        while time.monotonic() - sent < 5:
            try:
                status = health.Check(
                    health_pb2.HealthCheckRequest(service="fmaas.GenerationService"), timeout=1
                ).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(pb.BatchedGenerationRequest(requests=[{"text": "late"}]))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        results = await asyncio.gather(*unary, *streams)
        return results, time.monotonic() - sent

    results, drained_s = asyncio.run(run())
    for reply in results[:3]:
        assert (
            reply.responses[0].generated_token_count == 169
            and reply.responses[0].stop_reason == pb.MAX_TOKENS
        )
    for messages in results[3:]:
        assert messages[-1].generated_token_count == 169 and messages[-1].stop_reason == pb.MAX_TOKENS
    assert s.process.wait(60) == 0
    assert "drained in" in s.log()
    logger.info("drain took %.2f s", drained_s)


def test_a_dead_shard_fails_in_flight_requests_promptly(root) -> None:
    s = launch("llama", root)
    outcomes = outcomes_when(s, 6, shard_processes(s)[0].kill)
    # A status a client can act on (retry elsewhere), the same through unary, batch and stream.
    assert all(code == "UNAVAILABLE" for code, _ in outcomes), outcomes
    assert max(after for _, after in outcomes) < 3.0, outcomes
    assert s.process.wait(60) == 1
    termination = (root / "llama-termination.log").read_text()
    assert "Shard 0 exited with code -9" in termination
    logger.info("errors reached the clients %.2f s after the kill", max(a for _, a in outcomes))


def test_a_frozen_shard_fails_in_flight_requests_promptly(root) -> None:
    """SIGSTOP: the shard process exists but answers nothing; keepalive notices within seconds."""
    s = launch("llama", root)
    shard = shard_processes(s)[0]
    try:
        outcomes = outcomes_when(s, 3, shard.suspend)
    finally:
        shard.kill()
    assert all(code == "UNAVAILABLE" for code, _ in outcomes), outcomes
    assert max(after for _, after in outcomes) < 5.0, outcomes
    s.process.wait(60)
    logger.info("errors reached the clients %.2f s after the freeze", max(a for _, a in outcomes))


def test_traces_and_correlation_ids(root) -> None:
    """OTLP spans carry the client's W3C trace context; log lines carry x-correlation-id."""
    from tests.router.test_tracing import FakeCollector

    collector = FakeCollector()
    s = launch("llama", root, env={"OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}"})
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        s.stub().Generate(
            pb.BatchedGenerationRequest(
                requests=[{"text": STORY}], params={"stopping": {"max_new_tokens": 3}}
            ),
            metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01"), ("x-correlation-id", "corr-42")],
        )
    finally:
        s.stop()  # flushes the spans
        collector.server.stop(grace=None)
    spans = [span for _, span in collector.spans() if span.name == "Generate"]
    assert len(spans) == 1
    assert spans[0].trace_id.hex() == trace_id and spans[0].parent_span_id.hex() == parent_id
    line = next(line for line in s.log().splitlines() if "Request generated 3 tokens" in line)
    assert "correlation_id=corr-42" in line
