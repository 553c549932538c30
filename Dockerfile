# ttt-serve on Debian 12. The build stage installs the packages of deploy/debian-packages.txt.
FROM debian:12 AS build
WORKDIR /src
COPY deploy/debian-packages.txt deploy/
COPY tools/install-deps.sh tools/
RUN tools/install-deps.sh
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTTT_WITH_CUDA=OFF -DBUILD_TESTING=OFF \
 && cmake --build build \
 && install -D build/server/ttt-generate /out/bin/ttt-generate \
 && install -D build/bench/ttt-bench /out/bin/ttt-bench

FROM debian:12
COPY deploy/debian-packages.txt /tmp/
# The runtime needs the shared libraries the -dev packages pull in; installing the same list keeps
# one source of truth at the cost of image size.
COPY tools/install-deps.sh /tmp/tools/
RUN mkdir -p /tmp/deploy && mv /tmp/debian-packages.txt /tmp/deploy/ && /tmp/tools/install-deps.sh \
 && rm -rf /var/lib/apt/lists/* /tmp/deploy /tmp/tools
COPY --from=build /out/bin/ /usr/local/bin/
ENTRYPOINT ["ttt-generate"]
