"""`sm70ctl build`: the lock file, fetch and mirror, the patch series, content-addressed steps.

Modules: lock (parse/validate the lock), sources (git/archives/wheels, verified), mirror
(offline mirror: create/verify/locate), patches (check/apply the vllm_patch series),
steps (the content-addressed runner), toolchain (nvcc/gcc probes and verdicts), plan (the
step graph), runner (a build run: checks, log, progress), command (the CLI).
"""
