"""Bearer tokens: API keys, HS256 and public-key JWTs, and what each refusal says."""

from __future__ import annotations

import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from router.api.auth import AuthConfig, Authenticator, AuthError, parse_api_keys

SECRET = "another-secret-for-tests-0123456789"


def pem(public_key) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def test_off_by_default() -> None:
    auth = Authenticator(AuthConfig())
    assert not auth.enabled and auth.tenant(None) is None and auth.tenant("Bearer anything") is None


def test_api_keys() -> None:
    assert parse_api_keys(" a , b,,c ") == ("a", "b", "c") and parse_api_keys(None) == ()
    auth = Authenticator(AuthConfig(api_keys=("a", "b")))
    assert auth.tenant("Bearer b") == "key#2" and auth.tenant("bearer a") == "key#1"
    for header, message in [
        (None, "missing bearer token (Authorization: Bearer <token>)"),
        ("", "missing bearer token (Authorization: Bearer <token>)"),
        ("Basic YTpi", "malformed Authorization header: expected Bearer <token>"),
        ("Bearer ", "malformed Authorization header: expected Bearer <token>"),
        ("Bearer c", "invalid API key"),
    ]:
        with pytest.raises(AuthError) as error:
            auth.tenant(header)
        assert str(error.value) == message, header
    with pytest.raises(ValueError, match="empty keys"):
        AuthConfig(api_keys=("",))


def test_hs256_tokens_claims_and_tenant() -> None:
    auth = Authenticator(AuthConfig(jwt_secret=SECRET, jwt_audience="tgis", tenant_claim="team"))
    now = int(time.time())
    good = jwt.encode({"sub": "alice", "team": "search", "aud": "tgis", "exp": now + 60}, SECRET)
    assert auth.tenant(f"Bearer {good}") == "search"
    no_team = jwt.encode({"sub": "alice", "aud": "tgis"}, SECRET)
    assert auth.tenant(f"Bearer {no_team}") == "alice"  # falls back to sub
    cases = {
        jwt.encode({"sub": "a", "aud": "tgis", "exp": now - 5}, SECRET): "token expired",
        jwt.encode({"sub": "a", "aud": "tgis"}, "wrong-secret-wrong-secret-wrong!!"): (
            "invalid token: signature verification failed"
        ),
        jwt.encode({"sub": "a", "aud": "other"}, SECRET): "invalid token: Audience doesn't match",
        jwt.encode({"sub": "a", "aud": "tgis", "nbf": now + 600}, SECRET): (
            "invalid token: The token is not yet valid (nbf)"
        ),
        jwt.encode({"sub": "a", "aud": "tgis"}, SECRET, algorithm="HS512"): (
            "invalid token: algorithm HS512 is not accepted"
        ),
        "not-a-token": "invalid token: not a JWT",
    }
    for token, message in cases.items():
        with pytest.raises(AuthError) as error:
            auth.tenant(f"Bearer {token}")
        assert str(error.value) == message


@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_public_key_tokens(tmp_path: Path, kind: str) -> None:
    if kind == "rsa":
        private, algorithm = rsa.generate_private_key(public_exponent=65537, key_size=2048), "RS256"
    else:
        private, algorithm = ec.generate_private_key(ec.SECP256R1()), "ES256"
    path = tmp_path / "key.pem"
    path.write_bytes(pem(private.public_key()))
    auth = Authenticator(AuthConfig(jwt_public_key_path=str(path), jwt_issuer="issuer"))
    token = jwt.encode({"sub": "bob", "iss": "issuer"}, private, algorithm=algorithm)
    assert auth.tenant(f"Bearer {token}") == "bob"
    other = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )
    forged = jwt.encode({"sub": "bob", "iss": "issuer"}, other, algorithm=algorithm)
    with pytest.raises(AuthError, match="signature verification failed"):
        auth.tenant(f"Bearer {forged}")
    hs = jwt.encode({"sub": "bob", "iss": "issuer"}, "x" * 32)  # no secret configured: refused
    with pytest.raises(AuthError, match="algorithm HS256 is not accepted"):
        auth.tenant(f"Bearer {hs}")


def test_a_bad_public_key_file_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    path.write_text("not a key")
    with pytest.raises(ValueError, match="not a readable PEM public key"):
        Authenticator(AuthConfig(jwt_public_key_path=str(path)))
