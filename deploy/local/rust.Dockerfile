# A local stand-in for the official rust:1-slim-bookworm image, for machines that cannot pull
# from a container registry but reach Debian's package mirror: Debian's own Rust toolchain
# (rustc-web and cargo-web, a recent Rust in bookworm-security) on a Debian bookworm base.
#
# scripts/test-compose.sh builds it as pd-filter/rust-base:local, on top of a base it makes with
# debootstrap (BASE_IMAGE=pd-filter/debian-base:local), and hands it to deploy/mock/Dockerfile
# as RUST_IMAGE. Elsewhere the official image does the same job.
#
# Build context: a folder with a subfolder ca-certificates/, the extra certificate authorities
# (*.crt) the host trusts, perhaps none: cargo fetches crates over HTTPS, and a network whose
# egress proxy presents its own certificates needs them (the script copies the host's
# /usr/local/share/ca-certificates there).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY ca-certificates/ /usr/local/share/ca-certificates/
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        rustc-web cargo-web gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && update-ca-certificates \
    && cargo --version && rustc --version
