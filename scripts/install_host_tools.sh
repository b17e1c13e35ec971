#!/usr/bin/env bash
# Install what tests/faults/test_ray_up.py needs besides the hosts' own tools: sshd (ray up's local node provider
# logs in to each node over SSH) and rsync (its file mounts). Debian/Ubuntu, as root. The package's own service is
# kept from starting (policy-rc.d): the test starts an sshd of its own on each host's address only.
set -euo pipefail
policy=/usr/sbin/policy-rc.d
made=
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    made=1
fi
trap '[ -z "$made" ] || rm -f "$policy"' EXIT
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server rsync
