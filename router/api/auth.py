"""Authentication for every API door (off unless configured): static API keys and JWT bearer
tokens, one configuration for gRPC (metadata `authorization: Bearer <token>`) and HTTP (the
`Authorization` header).

A token is accepted when it equals one of API_KEY's keys (compared in constant time; its tenant
is `key#<n>`, the key's position, so logs never carry the key), or when it is a JWT that
verifies: HS256 with JWT_SECRET, or the algorithm of JWT_PUBLIC_KEY_PATH's key (RS256 for RSA,
ES256/ES384/ES512 for EC curves, EdDSA for Ed25519); `exp` and `nbf` are checked when present,
`aud`/`iss` when JWT_AUDIENCE/JWT_ISSUER are set. A JWT's tenant is its JWT_TENANT_CLAIM claim
(default `sub`). The tenant names the caller in the request log line and in the per-tenant
concurrency limit (TENANT_MAX_CONCURRENT_REQUESTS); the token itself is never logged.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from text_generation_common.logs import clip

BEARER = "bearer "


class AuthError(Exception):
    """The caller is not authenticated; str(error) says why (UNAUTHENTICATED / 401)."""


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    jwt_secret: str | None = None
    jwt_public_key_path: str | None = None
    jwt_audience: str | None = None
    jwt_issuer: str | None = None
    tenant_claim: str = "sub"
    protect_health: bool = False  # also require a token for /health* and /metrics
    tenant_max_concurrent_requests: int = 0  # 0 = no per-tenant limit

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("api_key: empty keys are not allowed")
        if self.jwt_secret is not None and not self.jwt_secret:
            raise ValueError("jwt_secret: must not be empty")
        if self.tenant_max_concurrent_requests < 0:
            raise ValueError("tenant_max_concurrent_requests must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.jwt_secret or self.jwt_public_key_path)


def parse_api_keys(value: str | None) -> tuple[str, ...]:
    """API_KEY: one key, or several separated by commas."""
    return tuple(key.strip() for key in (value or "").split(",") if key.strip())


def _algorithms_for(key: Any) -> list[str]:
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    if isinstance(key, rsa.RSAPublicKey):
        return ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512"]
    if isinstance(key, ec.EllipticCurvePublicKey):
        return {256: ["ES256"], 384: ["ES384"], 521: ["ES512"]}.get(key.curve.key_size, [])
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return ["EdDSA"]
    return []


class Authenticator:
    """Checks a call's bearer token; `Identity`-free: it answers the tenant name."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._public_key: Any = None
        self._public_algorithms: list[str] = []
        if config.jwt_public_key_path:
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            path = Path(config.jwt_public_key_path)
            try:
                self._public_key = load_pem_public_key(path.read_bytes())
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"jwt_public_key_path {path}: not a readable PEM public key ({exc})"
                ) from exc
            self._public_algorithms = _algorithms_for(self._public_key)
            if not self._public_algorithms:
                raise ValueError(
                    f"jwt_public_key_path {path}: unsupported key type {type(self._public_key).__name__}"
                )

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant for an `Authorization` value; None when auth is off; AuthError."""
        if not self.enabled:
            return None
        if not authorization:
            raise AuthError("missing bearer token (Authorization: Bearer <token>)")
        if not authorization[: len(BEARER)].lower() == BEARER or not authorization[len(BEARER) :].strip():
            raise AuthError("malformed Authorization header: expected Bearer <token>")
        token = authorization[len(BEARER) :].strip()
        for number, key in enumerate(self.config.api_keys, 1):
            if hmac.compare_digest(token.encode(), key.encode()):
                return f"key#{number}"
        if self.config.jwt_secret or self._public_key is not None:
            return self._jwt_tenant(token)
        raise AuthError("invalid API key")

    def _jwt_tenant(self, token: str) -> str:
        c = self.config
        if token.count(".") != 2:
            raise AuthError("invalid API key" if c.api_keys else "invalid token: not a JWT")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {clip(str(exc))}") from exc
        algorithm = header.get("alg")
        if algorithm == "HS256" and c.jwt_secret:
            key: Any = c.jwt_secret
        elif algorithm in self._public_algorithms:
            key = self._public_key
        else:
            raise AuthError(f"invalid token: algorithm {clip(str(algorithm))} is not accepted")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=c.jwt_audience,
                issuer=c.jwt_issuer,
                options={"verify_aud": c.jwt_audience is not None},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthError("token expired") from exc
        except jwt.InvalidSignatureError as exc:
            raise AuthError("invalid token: signature verification failed") from exc
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {clip(str(exc))}") from exc
        tenant = claims.get(c.tenant_claim, claims.get("sub"))
        return clip(str(tenant)) if tenant not in (None, "") else "jwt"
