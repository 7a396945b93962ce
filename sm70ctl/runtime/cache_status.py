"""Is the compile cache warm for these settings? (fast: no torch, one small subprocess)."""

from __future__ import annotations

from collections.abc import Mapping

from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.fingerprint import fingerprint, probe_components
from sm70ctl.runtime.manifest import (
    Verdict,
    assess,
    entry_dir,
    load_manifest,
    other_manifests,
)
from sm70ctl.settings.typed import SettingsView


def cache_status(
    settings: SettingsView, device: str, environ: Mapping[str, str] | None = None
) -> tuple[Verdict, dict[str, str]]:
    """The verdict for the current settings (and inherited environment), and the
    fingerprint components it used."""
    comps = probe_components(settings, device, environ=environ)
    fp = fingerprint(comps)
    entry = entry_dir(settings.cache_dir, fp)
    try:
        manifest = load_manifest(entry)
    except Sm70Error as exc:
        return Verdict(False, fp, f"the manifest is unreadable: {exc.message}; `sm70ctl warmup` "
                       "rebuilds the entry"), comps
    others = [] if manifest is not None else other_manifests(settings.cache_dir, fp)
    return assess(fp, comps, manifest, others), comps
