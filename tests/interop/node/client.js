// A Node.js client of ttt.v1 (@grpc/grpc-js, @grpc/proto-loader), loading the project's .proto.
// Usage: node client.js TARGET PROTO_ROOT < steps.json > results.json
// Each step is {"call": "Generate" | "CreateSession" | ..., "request": {...}}; each result is
// {"code": gRPC status code, "message": ..., "response" or "tokens": ...}.
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, protoRoot] = process.argv.slice(2);
const definition = protoLoader.loadSync(path.join(protoRoot, 'ttt/v1/ttt.proto'), {
  keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
  includeDirs: [protoRoot],
});
const ttt = grpc.loadPackageDefinition(definition).ttt.v1;
const client = new ttt.TttService(target, grpc.credentials.createInsecure());

function health() {
  // grpc.health.v1.Health/Check without its generated code: an empty request, and a response
  // whose field 1 (tag byte 0x08) holds the status.
  return new Promise((resolve) => {
    client.makeUnaryRequest('/grpc.health.v1.Health/Check', (x) => x, (x) => x, Buffer.alloc(0),
      (error, bytes) => {
        if (error) resolve({code: error.code, message: error.details});
        else resolve({code: 0, response: {status: bytes.length === 2 ? bytes[1] : 0}});
      });
  });
}

function generate(request) {
  return new Promise((resolve) => {
    const tokens = [];
    let last = null;
    const call = client.Generate(request);
    call.on('data', (message) => {
      for (const token of message.tokens) tokens.push({id: token.id, text: token.text});
      if (message.usage) last = message;
    });
    call.on('error', (error) => resolve({code: error.code, message: error.details, tokens}));
    call.on('end', () => resolve({code: 0, tokens,
                                  finish_reason: last ? last.finish_reason : null}));
  });
}

function unary(method, request) {
  return new Promise((resolve) => {
    client[method](request, (error, response) => {
      if (error) resolve({code: error.code, message: error.details});
      else resolve({code: 0, response});
    });
  });
}

async function main() {
  const steps = JSON.parse(require('fs').readFileSync(0, 'utf8'));
  const results = [];
  for (const step of steps) {
    if (step.call === 'Health') results.push(await health());
    else if (step.call === 'Generate') results.push(await generate(step.request));
    else results.push(await unary(step.call, step.request));
  }
  process.stdout.write(JSON.stringify(results) + '\n');
  client.close();
}

main();
