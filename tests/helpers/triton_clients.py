"""Drives a server with Triton's own clients (tritonclient.http and tritonclient.grpc), run by the Python of the
venv tests/helpers/tritonclient_env.py makes (tritonclient pins protobuf < 7: it cannot share the project's).

Reads one JSON object on stdin: {"http": "HOST:PORT", "grpc": "HOST:PORT", "cases": [{"model", "parameters",
"inputs": [{"name", "datatype", "shape", "npy"}], "outputs": [names]}]}, each input's values as a base64 .npy
(BYTES: an object array of bytes; BF16: its uint16 bit patterns, handed to the client as ml_dtypes.bfloat16, as
tritonclient >= 2.70 takes them). Writes one JSON object on stdout: health and
metadata as each client read them, and for each case and each way of sending it (http binary, http JSON, gRPC)
the outputs as the client decoded them (base64 .npy; BF16 outputs as their uint16 bit patterns), or the error the
client raised.
"""

from __future__ import annotations

import base64
import io
import json
import sys

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def _array(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=True)


def _encoded(array: np.ndarray) -> str:
    if array.dtype == ml_dtypes.bfloat16:
        array = array.view(np.uint16)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return base64.b64encode(buffer.getvalue()).decode()


def _infer(module, client, case: dict, binary: bool) -> dict:
    try:
        inputs = []
        for spec in case["inputs"]:
            tensor = module.InferInput(spec["name"], spec["shape"], spec["datatype"])
            values = _array(spec["npy"])
            if spec["datatype"] == "BF16":
                values = values.view(ml_dtypes.bfloat16)
            if module is httpclient:
                tensor.set_data_from_numpy(values, binary_data=binary)  # the client refuses BF16 in JSON
            else:
                tensor.set_data_from_numpy(values)
            inputs.append(tensor)
        outputs = [module.InferRequestedOutput(name, binary_data=binary) if module is httpclient
                   else module.InferRequestedOutput(name) for name in case["outputs"]]
        result = client.infer(case["model"], inputs, outputs=outputs or None, parameters=case.get("parameters"))
    except InferenceServerException as error:
        return {"error": error.message(), "status": str(error.status())}
    response = result.get_response()
    names = [output["name"] for output in response["outputs"]] if module is httpclient else \
        [output.name for output in response.outputs]
    return {"outputs": {name: _encoded(result.as_numpy(name)) for name in names},
            "model_version": response["model_version"] if module is httpclient else response.model_version}


def main() -> None:
    request = json.load(sys.stdin)
    http = httpclient.InferenceServerClient(request["http"])
    grpc = grpcclient.InferenceServerClient(request["grpc"])
    report: dict = {
        "http": {"live": http.is_server_live(), "ready": http.is_server_ready(),
                 "server": http.get_server_metadata(), "models": {}},
        "grpc": {"live": grpc.is_server_live(), "ready": grpc.is_server_ready(),
                 "server": grpc.get_server_metadata(as_json=True), "models": {}},
        "cases": [],
    }
    for model in sorted({case["model"] for case in request["cases"]}):
        report["http"]["models"][model] = {"ready": http.is_model_ready(model),
                                           "metadata": http.get_model_metadata(model)}
        report["grpc"]["models"][model] = {"ready": grpc.is_model_ready(model),
                                           "metadata": grpc.get_model_metadata(model, as_json=True)}
    report["http"]["missing_ready"] = http.is_model_ready("no_such_model")
    report["grpc"]["missing_ready"] = grpc.is_model_ready("no_such_model")
    for case in request["cases"]:
        report["cases"].append({"http_binary": _infer(httpclient, http, case, True),
                                "http_json": _infer(httpclient, http, case, False),
                                "grpc": _infer(grpcclient, grpc, case, True)})
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
