# ttt-server on Debian 12 with the bundled model (CPU engine; the CUDA backend needs an image with
# the CUDA toolkit).
#   docker build -t ttt-serve . && docker run -p 50051:50051 -p 9090:9090 ttt-serve
FROM debian:12 AS build
WORKDIR /src
COPY deploy/debian-packages.txt deploy/
COPY tools/install-deps.sh tools/
RUN tools/install-deps.sh --no-tests
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTTT_WITH_CUDA=OFF -DBUILD_TESTING=OFF \
 && cmake --build build \
 && install -D -t /out/bin build/server/ttt-server build/server/ttt-generate \
      build/client/ttt-client build/client/ttt-loadgen build/bench/ttt-bench \
 && install -D -t /out/lib build/lib/libttt_sentencepiece.so \
 && mkdir -p /out/share/ttt-serve && cp -r models /out/share/ttt-serve/

FROM debian:12
# The same package list (the -dev packages bring the shared libraries the binaries need).
COPY deploy/debian-packages.txt /tmp/deploy/
COPY tools/install-deps.sh /tmp/tools/
RUN /tmp/tools/install-deps.sh --no-tests && rm -rf /var/lib/apt/lists/* /tmp/deploy /tmp/tools
COPY --from=build /out/ /usr/local/
EXPOSE 50051 9090
# With no --model, ttt-server serves the bundled model (/usr/local/share/ttt-serve/models).
ENTRYPOINT ["ttt-server", "--host=0.0.0.0", "--port=50051", "--metrics-port=9090"]
