"""A custom import-linter contract (``pyproject.toml``, ``contract_types``): which modules may
import more of a foreign package than a permitted form.

import-linter sees an external package only as a whole (``aiohttp``), so a ``forbidden``
contract cannot tell an HTTP server's ``from aiohttp import web`` from an HTTP client's
``import aiohttp``.  This contract reads the import statements themselves (grimp's import
details): every module under ``source_modules`` that imports ``package`` must do so only with
one of the ``permitted`` lines, unless it is one of ``allowed_modules``.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class ImportFormContract(Contract):
    type_name = "import_form"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    package = fields.StringField()
    permitted = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.ModuleField(), required=False)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        roots = [m.name for m in self.source_modules]
        allowed = [m.name for m in self.allowed_modules or []]
        permitted = {str(p) for p in self.permitted}
        package = str(self.package)
        found: list[str] = []
        for module in sorted(graph.modules):
            if not any(module == r or module.startswith(r + ".") for r in roots):
                continue
            if any(module == a or module.startswith(a + ".") for a in allowed):
                continue
            if not graph.direct_import_exists(importer=module, imported=package):
                continue
            for detail in graph.get_import_details(importer=module, imported=package):
                line = str(detail["line_contents"]).strip()
                if line not in permitted:
                    found.append(f"{module}:{detail['line_number']}: {line}")
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        allowed = ", ".join(m.name for m in self.allowed_modules or []) or "none"
        permitted = ", ".join(map(str, self.permitted))
        output.print_error(f"Only {allowed} may import {self.package} beyond: {permitted}")
        output.new_line()
        for line in check.metadata["found"]:
            output.indent_cursor()
            output.print_error(line, bold=False)
        output.new_line()
