"""Images a goal starts from: an upload (base64 PNG or JPEG) or an earlier candidate's image.

Both end up as an artifact path (relative to the artifacts folder) in the goal's spec, which
the reviser hands to its candidates as their ``init_image`` and the worker loads. Uploads are
stored by content (``uploads/<sha256>.png``): the same image uploaded twice is one file, and a
goal that fails to be created leaves at most a file that the next upload of it reuses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from agentloop.domain import CandidateStatus, GoalSpec
from agentloop.settings import Settings

if TYPE_CHECKING:
    from agentloop.store import Store

UPLOADS = "uploads"
"""The folder under the artifacts folder that holds uploaded images."""

FORMATS = ("PNG", "JPEG")
_DATA_URL = re.compile(r"^data:image/[a-z+.-]+;base64,", re.IGNORECASE)


class InitImageInvalid(ValueError):
    """An init image was refused: `code` (`invalid_image`, `image_too_large`,
    `invalid_init_candidate`), the HTTP status that says so, and the field at fault."""

    def __init__(self, code: str, message: str, field: str, status: int = 422):
        super().__init__(message)
        self.code, self.message, self.field, self.status = code, message, field, status


def decode_image(data: str | bytes, settings: Settings, field: str = "init_image") -> bytes:
    """PNG or JPEG bytes checked to be one readable image within the settings' limits: base64
    text (a `data:image/...;base64,` prefix is allowed), or the bytes themselves."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, str):
        text = _DATA_URL.sub("", data.strip(), count=1)
        if len(text) * 3 // 4 > settings.max_init_image_bytes + 3:
            raise _too_large(settings, field)
        try:
            raw = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InitImageInvalid("invalid_image", "is not valid base64", field) from None
    else:
        raw = data
    if len(raw) > settings.max_init_image_bytes:
        raise _too_large(settings, field)
    if not raw:
        raise InitImageInvalid("invalid_image", "is empty", field)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in FORMATS:
                raise InitImageInvalid("invalid_image", f"is {image.format}, not PNG or JPEG", field)
            side = settings.max_init_image_side
            if max(image.size) > side:  # read from the header, before any pixel is decoded
                raise InitImageInvalid(
                    "invalid_image", f"is {image.size[0]}x{image.size[1]}; at most {side} "
                    "pixels a side", field)
            image.load()
    except InitImageInvalid:
        raise
    except UnidentifiedImageError:
        raise InitImageInvalid("invalid_image", "is not a readable PNG or JPEG image",
                               field) from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InitImageInvalid("invalid_image", f"is not a readable PNG or JPEG image ({exc})",
                               field) from None
    return raw


def _too_large(settings: Settings, field: str) -> InitImageInvalid:
    return InitImageInvalid(
        "image_too_large", f"is larger than {settings.max_init_image_bytes} bytes", field, 413)


def save_upload(raw: bytes, settings: Settings) -> str:
    """Store a checked image as RGB PNG under the uploads folder; its artifact path."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as image:
        rgb = image.convert("RGB")
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    png = out.getvalue()
    name = f"{hashlib.sha256(png).hexdigest()}.png"
    folder = settings.resolved_artifacts_dir() / UPLOADS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(png)
        os.replace(tmp, path)
    return f"{UPLOADS}/{name}"


def candidate_image(store: Store, candidate_id: str, tenant: str, settings: Settings) -> str:
    """The artifact path of an earlier candidate's image, for a goal of `tenant`: it must be
    a succeeded candidate of a goal of the same tenant, with its image still on disk."""
    field = "init_candidate_id"
    found = store.get_candidates([candidate_id])
    goal = store.get_goal(found[0].goal_id) if found else None
    if not found or goal is None or goal.tenant != tenant:
        raise InitImageInvalid("invalid_init_candidate", f"no candidate {candidate_id!r}", field)
    cand = found[0]
    if cand.status is not CandidateStatus.SUCCEEDED or cand.artifact_uri is None:
        raise InitImageInvalid("invalid_init_candidate",
                               f"candidate {candidate_id!r} has no image (it is {cand.status.value})",
                               field)
    if not (settings.resolved_artifacts_dir() / cand.artifact_uri).is_file():
        raise InitImageInvalid("invalid_init_candidate",
                               f"candidate {candidate_id!r}'s image is gone", field)
    return cand.artifact_uri


def resolve_init(
    spec: GoalSpec, store: Store, settings: Settings, init_image: str | bytes | None,
    init_candidate_id: str | None,
) -> GoalSpec:
    """The spec with its init image stored and named (an upload, or an earlier candidate's
    image); unchanged when the goal starts from text. Raises InitImageInvalid."""
    if init_image is not None:
        return replace(spec, init_image=save_upload(decode_image(init_image, settings), settings))
    if init_candidate_id is not None:
        path = candidate_image(store, init_candidate_id, spec.tenant, settings)
        return replace(spec, init_image=path, init_candidate_id=init_candidate_id)
    return spec


def load_artifact(root: Path, path: str):  # noqa: ANN201 - PIL image, imported lazily
    """An artifact image as RGB; FileNotFoundError (or ValueError for a path outside the
    artifacts folder) when it cannot be read."""
    from PIL import Image

    full = (root / path).resolve()
    if root.resolve() not in full.parents:
        raise ValueError(f"init image {path!r} is outside the artifacts folder")
    with Image.open(full) as image:
        return image.convert("RGB")
