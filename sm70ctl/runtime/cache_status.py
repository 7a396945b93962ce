"""Is the compile cache warm for these settings? (fast: no torch, one small subprocess)."""

from __future__ import annotations

from collections.abc import Mapping

from sm70ctl.runtime.fingerprint import fingerprint, probe_components
from sm70ctl.runtime.manifest import (
    MANIFEST,
    Verdict,
    assess,
    entry_dir,
    other_manifests,
    read_manifest,
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
    manifest = read_manifest(entry)
    if manifest is None and (entry / MANIFEST).exists():
        return Verdict(False, fp, f"the manifest {entry / MANIFEST} is unreadable (damaged); "
                       "`sm70ctl warmup` rebuilds the entry"), comps
    others = [] if manifest is not None else other_manifests(settings.cache_dir, fp)
    return assess(fp, comps, manifest, others), comps
