#!/usr/bin/env bash
# A real CUDA 12.4 nvcc for the sm_70 compile of the whole torch extension
# (tests/test_extension_nvcc.py), assembled without installing anything
# (TOOLCHAIN.md, route B): NVIDIA's nvcc, cicc, cudafe++, fatbinary, nvlink and cuobjdump
# from Debian trixie's nvidia-cuda-toolkit .deb (downloaded with a private sources list,
# signature-checked by apt, unpacked with dpkg -x), ptxas, libnvvm and libdevice from
# PyPI's nvidia-cuda-nvcc-cu12, the runtime headers and libcudart from
# nvidia-cuda-runtime-cu12, and CCCL 12.8 (12.4's lacks nv/target and cuda/std).
# Result: build/ci/cuda-12.4 (about 220 MB, under a minute). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
top=$PWD/build/ci
dest=$top/cuda-12.4
if [ -x "$dest/bin/nvcc" ] && "$dest/bin/nvcc" --version | grep -q "release 12.4"; then
  echo "cuda-12.4: $dest present; skipping"
  exit 0
fi
work=$top/cuda-12.4.work
rm -rf "$work" "$dest"
mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial" "$work/apt/cache"
echo "deb http://deb.debian.org/debian trixie main contrib non-free" >"$work/apt/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
  -o "Dir::Cache::Archives=$work/apt/archives" -o APT::Architecture=amd64
  -o "APT::Sandbox::User=$(id -un)")
apt-get "${apt_opts[@]}" -q update >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" -q download "nvidia-cuda-toolkit=12.4.131~12.4.1-2")
dpkg -x "$work"/nvidia-cuda-toolkit_*.deb "$work/deb"
python -m pip install -q --target "$work/py" nvidia-cuda-nvcc-cu12==12.4.131 \
  nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-cccl-cu12==12.8.90

tree=$work/tree
mkdir -p "$tree"/{bin,nvvm/bin,nvvm/lib64,nvvm/libdevice,include,lib64}
for t in cudafe++ fatbinary nvlink bin2c cuobjdump nvdisasm; do cp "$work/deb/usr/bin/$t" "$tree/bin/"; done
cp "$work/deb/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$tree/bin/"
cp "$work/deb/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$tree/nvvm/bin/"
nv=$work/py/nvidia
cp "$nv/cuda_nvcc/bin/ptxas" "$tree/bin/"
cp -r "$nv/cuda_nvcc/nvvm/lib64/." "$tree/nvvm/lib64/"
cp -r "$nv/cuda_nvcc/nvvm/libdevice/." "$tree/nvvm/libdevice/"
for inc in cuda_runtime cuda_cccl cuda_nvcc; do cp -r "$nv/$inc/include/." "$tree/include/"; done
cp "$nv/cuda_runtime/lib/libcudart.so.12" "$tree/lib64/"
ln -sf libcudart.so.12 "$tree/lib64/libcudart.so"
ar rcs "$tree/lib64/libcudadevrt.a"  # nvcc's default link names it; we never link device code
cat >"$tree/bin/nvcc.profile" <<'PROFILE'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
PROFILE
chmod +x "$tree"/bin/* "$tree"/nvvm/bin/*
printf '__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n' >"$work/probe.cu"
"$tree/bin/nvcc" -arch=sm_70 -c "$work/probe.cu" -o "$work/probe.o"
mv "$tree" "$dest"
rm -rf "$work"
echo "cuda-12.4: $dest ready ($("$dest/bin/nvcc" --version | tail -1))"
