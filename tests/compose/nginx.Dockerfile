# A stand-in for nginx:1.28-alpine where Docker Hub is not reachable (tests/compose_up.sh):
# Debian's nginx-light on the local Debian base, with what compose.yaml's nginx service uses of
# the official image: /docker-entrypoint.sh's templates, busybox nslookup, an nc with -z
# (Debian's busybox has none: netcat-openbsd), logs to the container's output.
ARG BASE_IMAGE=slotwise-standin/python:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends nginx-light busybox gettext-base netcat-openbsd \
 && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/default \
 && mkdir -p /etc/nginx/templates \
 && ln -sf /dev/stdout /var/log/nginx/access.log \
 && ln -sf /dev/stderr /var/log/nginx/error.log \
 && ln -s /bin/busybox /usr/local/bin/nslookup
COPY nginx-entrypoint.sh /docker-entrypoint.sh
ENTRYPOINT ["/docker-entrypoint.sh"]
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
