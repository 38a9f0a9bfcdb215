"""tools/lab/tiny_isa_digests.py: MKL's own report of its code path and CNR mode is read from MKL_VERBOSE's lines
(as MKL 2024.2 printed them on this team's Intel Xeon, session 45), and a setting never inherits another's kernel
variables from the caller's environment."""

from __future__ import annotations

from tools.lab.tiny_isa_digests import KERNEL_VARIABLES, SETTINGS, mkl_path

BANNER = ("MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture Intel(R) Advanced "
          "Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx 2.79GHz lp64 gnu_thread")
CALL = ("MKL_VERBOSE SGEMM(N,N,64,64,64,0x7fff,0x5639,64,0x5639,64,0x7fff,0x5639,64) 8.04ms CNR:AVX2 Dyn:1 "
        "FastMM:1 TID:0  NThr:2")


def test_mkl_path_is_mkl_s_banner_and_cnr_mode():
    assert mkl_path([BANNER, CALL, '{"payload_digest": "x"}']) == {
        "mkl_path": "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors", "mkl_cnr": "AVX2"}
    compatible = BANNER.replace("Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors",
                                "Intel(R) Architecture processors")
    assert mkl_path([compatible, CALL.replace("CNR:AVX2", "CNR:COMPATIBLE,STRICT")]) == {
        "mkl_path": "Intel(R) Architecture processors", "mkl_cnr": "COMPATIBLE,STRICT"}


def test_mkl_path_without_mkl_s_lines_is_not_measured():
    assert mkl_path(['{"payload_digest": "x"}']) == {"mkl_path": "not_measured", "mkl_cnr": "not_measured"}


def test_every_setting_names_only_kernel_variables():
    for name, env in SETTINGS.items():
        assert set(env) <= set(KERNEL_VARIABLES), (name, env)
