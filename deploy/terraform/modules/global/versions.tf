terraform {
  # 1.9: a validation block may refer to other variables (admin_port != read_port).
  required_version = ">= 1.9.0, < 2.0.0"

  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.35"
    }
  }
}
