#!/bin/sh
# Installed by scripts/lib.sh only while apt installs the test tools: "do not start services" (exit 101,
# invoke-rc.d(8)), so Debian's nginx and Prometheus packages start no daemon. Removed right after.
exit 101
